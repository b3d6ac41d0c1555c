"""Programmatic dependent launch on the GPU: run(enable_pdl=True) equals run(enable_pdl=False) bit for
bit and matches attnforge.reference, on every wrapper (CUDA-core and tensor-core decode, fa2/fa3
prefill, paged and ragged, split-KV so that the merge kernel runs too); and chains of runs whose
inputs the kernel just before wrote (the previous run's output as q, or as K; a torch kernel
rewriting the cache) read what was written: a kernel that read before its griddepcontrol.wait would
see the previous step's values, since every kernel lets its successor launch before it stores its
output. A chain captured into a CUDA graph replays the same. Few, small shapes: the drawn-shape
coverage is the other kernel tests', which run with PDL on (the default) on sm90+."""

from __future__ import annotations

import math

import pytest
import torch

import attnforge
from attnforge import reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
WORKSPACE = 128 << 20
DTYPE = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)
LSE_TOL = dict(atol=1e-2, rtol=1e-3)
HEAD_DIM = 128
PAGE = 16


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="fa3 and PDL need sm90+")


def indptr_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


class Paged:
    """A paged NHD cache holding kv_lens tokens per request on scattered pages."""

    def __init__(self, kv_lens: list[int], num_kv_heads: int, seed: int):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        pages = [math.ceil(n / PAGE) for n in kv_lens]
        pool = sum(pages) + 7
        self.k, self.v = (torch.randn(pool, PAGE, num_kv_heads, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
                          for _ in "kv")
        self.indptr = indptr_of(pages)
        self.indices = torch.randperm(pool, device=DEVICE, generator=gen)[: sum(pages)].int()
        self.last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, pages)], dtype=torch.int32)

    @property
    def cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


# ---------------------------------------------------------------------------------------
# decode

DECODE_PATHS = {"cuda_cores": dict(use_tensor_cores=False),
                "tensor_cores_fa2": dict(use_tensor_cores=True, backend="fa2"),
                "tensor_cores_fa3": dict(use_tensor_cores=True, backend="fa3")}
DECODE_KV_LENS = [1, 17, 300, 2048, 5000, 33, 900]  # long ones split (fixed_split_size), so the merge runs
DECODE_HEADS = (32, 8)


def decode_wrapper(path: str, cache: Paged, **extra):
    if path.endswith("fa3") and not _sm90():
        pytest.skip("fa3 needs sm90a")
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE), **DECODE_PATHS[path], **extra)
    return wrapper


def plan_decode(wrapper, cache: Paged, fixed_split_size: int | None = 32) -> None:
    wrapper.plan(cache.indptr, cache.indices, cache.last, *DECODE_HEADS, HEAD_DIM, PAGE, q_data_type=DTYPE,
                 fixed_split_size=fixed_split_size)


def decode_reference(q, cache: Paged):
    return reference.batch_decode_paged(q, cache.cache, cache.indptr, cache.indices, cache.last)


@pytest.mark.parametrize("path", sorted(DECODE_PATHS))
def test_decode_with_pdl_equals_without_and_matches_reference(path):
    cache = Paged(DECODE_KV_LENS, DECODE_HEADS[1], seed=1)
    q = torch.randn(len(DECODE_KV_LENS), DECODE_HEADS[0], HEAD_DIM, dtype=DTYPE, device=DEVICE,
                    generator=torch.Generator(device=DEVICE).manual_seed(2))
    wrapper = decode_wrapper(path, cache)
    plan_decode(wrapper, cache)
    results = {}
    for pdl in (False, True):
        out = torch.full_like(q, math.nan)
        lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=DEVICE)
        results[pdl] = wrapper.run(q, cache.cache, out=out, lse=lse, return_lse=True, enable_pdl=pdl)
    torch.cuda.synchronize()
    assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])
    o_ref, lse_ref = decode_reference(q, cache)
    torch.testing.assert_close(results[True][0].float(), o_ref, **TOL)
    torch.testing.assert_close(results[True][1], lse_ref, **LSE_TOL)


def test_enable_pdl_is_on_by_default_only_on_sm90():
    cache = Paged([40, 70], DECODE_HEADS[1], seed=3)
    q = torch.randn(2, DECODE_HEADS[0], HEAD_DIM, dtype=DTYPE, device=DEVICE)
    wrapper = decode_wrapper("cuda_cores", cache)
    plan_decode(wrapper, cache)
    wrapper.run(q, cache.cache)
    assert wrapper._plan.params.enable_pdl == int(_sm90())
    wrapper.run(q, cache.cache, enable_pdl=True)  # a request: honoured only on sm90+
    assert wrapper._plan.params.enable_pdl == int(_sm90())
    wrapper.run(q, cache.cache, enable_pdl=False)
    assert wrapper._plan.params.enable_pdl == 0


def decode_chain(path: str, pdl: bool, steps: int, cache: Paged, q0: torch.Tensor) -> list[torch.Tensor]:
    """steps runs back to back: before run i a torch kernel negates V (the cache written right before
    the launch), and run i's q is run i-1's output (written by the kernel right before). Returns
    [q0, o_1, ..., o_steps]."""
    wrapper = decode_wrapper(path, cache)
    plan_decode(wrapper, cache)
    outs = [q0] + [torch.full_like(q0, math.nan) for _ in range(steps)]
    for i in range(steps):
        cache.v.neg_()
        wrapper.run(outs[i], cache.cache, out=outs[i + 1], enable_pdl=pdl)
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("path", sorted(DECODE_PATHS))
def test_back_to_back_decode_reads_what_the_kernel_before_wrote(path):
    steps = 6
    q0 = torch.randn(len(DECODE_KV_LENS), DECODE_HEADS[0], HEAD_DIM, dtype=DTYPE, device=DEVICE,
                     generator=torch.Generator(device=DEVICE).manual_seed(4)) * 8
    chains = {}
    for pdl in (False, True):
        cache = Paged(DECODE_KV_LENS, DECODE_HEADS[1], seed=5)
        chains[pdl] = decode_chain(path, pdl, steps, cache, q0)
    for i in range(1, steps + 1):
        assert torch.equal(chains[True][i], chains[False][i]), f"step {i}: PDL changed the output"
    cache = Paged(DECODE_KV_LENS, DECODE_HEADS[1], seed=5)  # replayed on the host, step by step
    for i in range(steps):
        cache.v.neg_()
        o_ref, _ = decode_reference(chains[True][i], cache)
        torch.testing.assert_close(chains[True][i + 1].float(), o_ref, **TOL, msg=f"step {i + 1}")


def test_pdl_decode_chain_replays_in_a_cuda_graph():
    """PDL launches captured back to back (programmatic edges) replay to the eager result."""
    steps, batch = 4, len(DECODE_KV_LENS)
    cache = Paged(DECODE_KV_LENS, DECODE_HEADS[1], seed=6)
    q0 = torch.randn(batch, DECODE_HEADS[0], HEAD_DIM, dtype=DTYPE, device=DEVICE,
                     generator=torch.Generator(device=DEVICE).manual_seed(7)) * 8
    wrapper = decode_wrapper("cuda_cores", cache, use_cuda_graph=True,
                             paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
                             paged_kv_indices_buffer=torch.empty(cache.indices.numel(), dtype=torch.int32,
                                                                 device=DEVICE),
                             paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=DEVICE))
    plan_decode(wrapper, cache, fixed_split_size=None)  # a small batch: the planner splits the long requests
    outs = [q0.clone()] + [torch.empty_like(q0) for _ in range(steps)]

    def chain():
        for i in range(steps):
            wrapper.run(outs[i], cache.cache, out=outs[i + 1], enable_pdl=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for o in outs[1:]:
        o.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    eager = [q0]
    for i in range(steps):
        eager.append(wrapper.run(eager[i], cache.cache, enable_pdl=False))
    torch.cuda.synchronize()
    for i in range(1, steps + 1):
        assert torch.equal(outs[i], eager[i]), f"step {i}: the replay differs from the eager run"


# ---------------------------------------------------------------------------------------
# prefill

QO_LENS, KV_LENS = [1, 100, 300], [500, 100, 700]
PREFILL_HEADS = (8, 2)


def prefill_wrapper(backend: str, paged: bool):
    if backend == "fa3" and not _sm90():
        pytest.skip("fa3 needs sm90a")
    kind = attnforge.BatchPrefillWithPagedKVCacheWrapper if paged else attnforge.BatchPrefillWithRaggedKVCacheWrapper
    return kind(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE), backend=backend)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_prefill_with_pdl_equals_without_and_matches_reference(backend, paged):
    gen = torch.Generator(device=DEVICE).manual_seed(8)
    q = torch.randn(sum(QO_LENS), PREFILL_HEADS[0], HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
    k, v = (torch.randn(sum(KV_LENS), PREFILL_HEADS[1], HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
            for _ in "kv")
    wrapper = prefill_wrapper(backend, paged)
    qo_indptr, kv_indptr = indptr_of(QO_LENS), indptr_of(KV_LENS)
    if paged:
        cache = Paged(KV_LENS, PREFILL_HEADS[1], seed=9)
        wrapper.plan(qo_indptr, cache.indptr, cache.indices, cache.last, *PREFILL_HEADS, HEAD_DIM, PAGE, causal=True,
                     q_data_type=DTYPE, fixed_split_size=8)
        run = lambda pdl: wrapper.run(q, cache.cache, return_lse=True, enable_pdl=pdl)  # noqa: E731
        o_ref, lse_ref = reference.batch_prefill_paged(q, cache.cache, qo_indptr, cache.indptr, cache.indices,
                                                       cache.last, causal=True, o_dtype=torch.float32)
    else:
        wrapper.plan(qo_indptr, kv_indptr, *PREFILL_HEADS, HEAD_DIM, causal=True, q_data_type=DTYPE,
                     fixed_split_size=128)
        run = lambda pdl: wrapper.run(q, k, v, return_lse=True, enable_pdl=pdl)  # noqa: E731
        o_ref, lse_ref = reference.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, causal=True,
                                                        o_dtype=torch.float32)
    off, on = run(False), run(True)
    torch.cuda.synchronize()
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    torch.testing.assert_close(on[0].float(), o_ref, **TOL)
    torch.testing.assert_close(on[1], lse_ref, **LSE_TOL)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_back_to_back_prefill_reads_what_the_kernel_before_wrote(backend):
    """Ragged, one kv head per query head and as many keys as queries: run i's q and k are run i-1's
    output, written by the kernel launched right before."""
    steps, lens, heads = 5, [64, 333, 1000], 4
    gen = torch.Generator(device=DEVICE).manual_seed(10)
    q0 = torch.randn(sum(lens), heads, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen) * 4
    v = torch.randn(sum(lens), heads, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
    indptr = indptr_of(lens)
    chains = {}
    for pdl in (False, True):
        wrapper = prefill_wrapper(backend, paged=False)
        wrapper.plan(indptr, indptr, heads, heads, HEAD_DIM, causal=True, q_data_type=DTYPE, fixed_split_size=256)
        outs = [q0] + [torch.full_like(q0, math.nan) for _ in range(steps)]
        for i in range(steps):
            wrapper.run(outs[i], outs[i], v, out=outs[i + 1], enable_pdl=pdl)
        torch.cuda.synchronize()
        chains[pdl] = outs
    for i in range(1, steps + 1):
        assert torch.equal(chains[True][i], chains[False][i]), f"step {i}: PDL changed the output"
        previous = chains[True][i - 1]
        o_ref, _ = reference.batch_prefill_ragged(previous, previous, v, indptr, indptr, causal=True,
                                                  o_dtype=torch.float32)
        torch.testing.assert_close(chains[True][i].float(), o_ref, **TOL, msg=f"step {i}")


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_back_to_back_paged_prefill_reads_the_cache_a_kernel_just_wrote(backend):
    """Paged (fa3 may gather the pages ahead): before each run a torch kernel negates V, and q is the
    previous run's output."""
    steps = 4
    chains = {}
    for pdl in (False, True):
        cache = Paged(KV_LENS, PREFILL_HEADS[1], seed=11)
        wrapper = prefill_wrapper(backend, paged=True)
        wrapper.plan(indptr_of(QO_LENS), cache.indptr, cache.indices, cache.last, *PREFILL_HEADS, HEAD_DIM, PAGE,
                     causal=True, q_data_type=DTYPE)
        q0 = torch.randn(sum(QO_LENS), PREFILL_HEADS[0], HEAD_DIM, dtype=DTYPE, device=DEVICE,
                         generator=torch.Generator(device=DEVICE).manual_seed(12)) * 8
        outs = [q0] + [torch.full_like(q0, math.nan) for _ in range(steps)]
        for i in range(steps):
            cache.v.neg_()
            wrapper.run(outs[i], cache.cache, out=outs[i + 1], enable_pdl=pdl)
        torch.cuda.synchronize()
        chains[pdl] = outs
    cache = Paged(KV_LENS, PREFILL_HEADS[1], seed=11)
    for i in range(1, steps + 1):
        assert torch.equal(chains[True][i], chains[False][i]), f"step {i}: PDL changed the output"
        cache.v.neg_()
        o_ref, _ = reference.batch_prefill_paged(chains[True][i - 1], cache.cache, indptr_of(QO_LENS), cache.indptr,
                                                 cache.indices, cache.last, causal=True, o_dtype=torch.float32)
        torch.testing.assert_close(chains[True][i].float(), o_ref, **TOL, msg=f"step {i}")
