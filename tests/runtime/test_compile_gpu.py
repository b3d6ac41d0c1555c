"""torch.compile(fullgraph=True) over attnforge calls on a GPU (issue 37 item 6): every run() and the
merge and single_* functions compile without a graph break (fullgraph=True raises on one) and give
exactly eager's numbers (the compiled graph calls the same kernels through the custom ops of
runtime/compile_ops.py). plan() stays eager: a later plan() with other lengths reuses the compiled
graph without recompiling.

Modules: fa2 decode and fa2 prefill, bf16, head dim 128 (one build each, shared with the other GPU
tests). Inductor compiles where Triton is installed, else aot_eager (same tracing, fake kernels and
functionalization, no code generation).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import attnforge

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16
HQ, HKV, HD, PAGE, NUM_PAGES = 8, 2, 128, 16, 64


def _backend() -> str:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return "aot_eager"
    return "inductor" if has_triton() else "aot_eager"


def _compile(fn):
    return torch.compile(fn, fullgraph=True, backend=_backend())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _equal(got, expected) -> None:
    """Equal to the bit: the compiled graph runs eager's kernels on eager's inputs."""
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


def _same(compiled, eager, *args) -> None:
    """compiled(*args) equals eager(*args), eager running first."""
    expected = eager(*args)
    _equal(compiled(*args), expected)


def _randn(gen, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, BF16)


def _indptr(lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _page_table(kv_lens, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr, indices, last_page_len) of requests of kv_lens tokens on shuffled pages of the cache."""
    pages = [-(-n // PAGE) for n in kv_lens]
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return _indptr(pages), torch.randperm(NUM_PAGES, generator=gen)[: sum(pages)].to(torch.int32), last


def _workspace() -> torch.Tensor:
    return torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE)


@pytest.fixture(scope="module")
def cache() -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache), NHD pages."""
    gen = torch.Generator().manual_seed(0)
    return _randn(gen, NUM_PAGES, PAGE, HKV, HD), _randn(gen, NUM_PAGES, PAGE, HKV, HD)


def _decode_wrapper(kind: str, batch: int):
    if kind == "cuda_graph":
        buffers = (torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
                   torch.empty(NUM_PAGES, dtype=torch.int32, device=DEVICE),
                   torch.empty(batch, dtype=torch.int32, device=DEVICE))
        return attnforge.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_workspace(), *buffers)
    return attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace(), use_tensor_cores=kind == "tensor_cores")


@pytest.mark.parametrize("kind", ["cuda_cores", "tensor_cores", "cuda_graph"])
def test_decode_run_compiles_to_eager_and_survives_replans(cache, kind):
    gen = torch.Generator().manual_seed(1)
    w = _decode_wrapper(kind, batch=3)
    q = _randn(gen, 3, HQ, HD)

    def step(q, k_cache, v_cache, out):
        o, lse = w.run(q, (k_cache, v_cache), return_lse=True)
        w.run(q, (k_cache, v_cache), out=out, v_scale=0.5)  # the out= op, which writes the caller's `out`
        return o, lse

    compiled = _compile(step)
    for replan, step_lens in enumerate(([30, 90, 5], [64, 7, 33])):
        w.plan(*_page_table(step_lens, gen), HQ, HKV, HD, PAGE, q_data_type=BF16)
        out, compiled_out = (torch.full((3, HQ, HD), float("nan"), dtype=BF16, device=DEVICE) for _ in "ab")
        expected = (*step(q, *cache, out), out)
        with torch._dynamo.config.patch(error_on_recompile=bool(replan)):
            _equal((*compiled(q, *cache, compiled_out), compiled_out), expected)


def test_paged_prefill_run_compiles_to_eager(cache):
    gen = torch.Generator().manual_seed(2)
    qo_lens = [5, 1, 17]
    w = attnforge.BatchPrefillWithPagedKVCacheWrapper(_workspace(), backend="fa2")
    w.plan(_indptr(qo_lens), *_page_table([30, 90, 40], gen), HQ, HKV, HD, PAGE, causal=True, q_data_type=BF16)
    q = _randn(gen, sum(qo_lens), HQ, HD)

    def attend(q, kv):
        return (w.run(q, kv),)

    _same(_compile(attend), attend, q, cache)


def test_ragged_prefill_with_lse_and_merges_compile_to_eager():
    """Cascade-style: new tokens (causal) and a shared prefix (not causal) as two ragged runs with
    their LSEs, combined by merge_state, merge_state_in_place and merge_states in the same graph."""
    gen = torch.Generator().manual_seed(3)
    qo_lens, prefix_lens = [5, 12, 1], [20, 3, 45]
    new = attnforge.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), backend="fa2")
    new.plan(_indptr(qo_lens), _indptr(qo_lens), HQ, HKV, HD, causal=True, q_data_type=BF16)
    prefix = attnforge.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), backend="fa2")
    prefix.plan(_indptr(qo_lens), _indptr(prefix_lens), HQ, HKV, HD, q_data_type=BF16)
    q, k, v = (_randn(gen, sum(qo_lens), h, HD) for h in (HQ, HKV, HKV))
    k_prefix, v_prefix = (_randn(gen, sum(prefix_lens), HKV, HD) for _ in "kv")

    def attend(q, k, v, k_prefix, v_prefix):
        o1, s1 = new.run(q, k, v, return_lse=True)
        o2, s2 = prefix.run_return_lse(q, k_prefix, v_prefix)
        o, s = attnforge.merge_state(o1, s1, o2, s2)
        o_in_place, s_in_place = o1.clone(), s1.clone()
        attnforge.merge_state_in_place(o_in_place, s_in_place, o2, s2)
        o_many, s_many = attnforge.merge_states(torch.stack([o1, o2], dim=1), torch.stack([s1, s2], dim=1))
        return o1, s1, o, s, o_in_place, s_in_place, o_many, s_many

    _same(_compile(attend), attend, q, k, v, k_prefix, v_prefix)


def test_single_decode_and_prefill_compile_to_eager():
    gen = torch.Generator().manual_seed(4)
    q1, q = _randn(gen, HQ, HD), _randn(gen, 9, HQ, HD)
    k, v = (_randn(gen, 70, HKV, HD) for _ in "kv")

    def attend(q1, q, k, v):
        o1, s1 = attnforge.single_decode_with_kv_cache(q1, k, v, return_lse=True)
        o2 = attnforge.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")
        o3, s3 = attnforge.single_prefill_with_kv_cache_return_lse(q, k, v, backend="fa2", k_scale=0.5, v_scale=2.0)
        return o1, s1, o2, o3, s3

    _same(_compile(attend), attend, q1, q, k, v)


def test_opcheck_batch_ops(cache):
    """torch.library.opcheck's schema, fake-tensor and AOT-dispatch checks on a functional and an out= op."""
    gen = torch.Generator().manual_seed(5)
    no_scales, no_extras = ([None, None, None], None, None, None), (None, None, None)
    decode = attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    decode.plan(*_page_table([30, 90, 5], gen), HQ, HKV, HD, PAGE, q_data_type=BF16)
    q = _randn(gen, 3, HQ, HD)
    torch.library.opcheck(torch.ops.attnforge.batch_decode_run.default,
                          (decode._handle, q, *cache, [], *no_scales, *no_extras, True, BF16))

    qo_lens = [5, 12]
    ragged = attnforge.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), backend="fa2")
    ragged.plan(_indptr(qo_lens), _indptr(qo_lens), HQ, HKV, HD, q_data_type=BF16)
    q, k, v = (_randn(gen, sum(qo_lens), h, HD) for h in (HQ, HKV, HKV))
    out = torch.empty(sum(qo_lens), HQ, HD, dtype=BF16, device=DEVICE)
    lse = torch.empty(sum(qo_lens), HQ, dtype=torch.float32, device=DEVICE)
    torch.library.opcheck(torch.ops.attnforge.batch_prefill_ragged_run_out.default,
                          (ragged._handle, q, k, v, [], *no_scales, *no_extras, out, lse))
