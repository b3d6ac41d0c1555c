"""Attention sinks (gpt-oss; FlashInfer's run(sinks=)) on the GPU, against attnforge.reference.

A sink is one fp32 logit per query head, in the units of the scaled scores, added to each row's
softmax denominator as a key with no value; the base-2 lse counts it. The kernels join it once per
output row: in the attention kernel's epilogue for a row written to o, in the split-KV merge for a
split row. So every family runs here with and without a forced split (fixed_split_size), with
outputs NaN-poisoned, NaN in the cache rows no request owns, randn inputs and sinks drawn over the
range where they matter (comparable to a row's log-sum-exp). Modules: the default manifest's hd 128
(decode bf16 / e4m3 KV, with a window for bf16; prefill fa2 bf16 with and without a window; fa3
bf16 and e4m3).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import attnforge
from attnforge import reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
WORKSPACE_BYTES = 128 << 20
HEAD_DIM = 128
E4M3 = torch.float8_e4m3fn
# relative L2 error of o against the fp32 reference, per the dtype that rounds most
TOL = {torch.bfloat16: 1e-2, E4M3: 4e-2}
KV_SCALES = dict(k_scale=0.5, v_scale=1.5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _sinks(gen: torch.Generator, heads: int) -> torch.Tensor:
    """Sinks from -2 to 8: below, near and above a row's log-sum-exp of randn scores over ~100 keys."""
    return torch.rand(heads, device=DEVICE, generator=gen) * 10 - 2


class Cache:
    """A paged NHD cache of randn K/V for requests of kv_lens tokens, in shuffled pages of a pool
    whose unowned rows hold NaN; k/v [total_kv, heads, dim] fp32 are the values the pages hold."""

    def __init__(self, gen: torch.Generator, kv_lens: list[int], kv_heads: int, page_size: int, dtype: torch.dtype):
        self.page_size, self.kv_lens = page_size, kv_lens
        pages = [-(-n // page_size) for n in kv_lens]
        pool = sum(pages) + 3
        self.ids = torch.randperm(pool, device=DEVICE, generator=gen)[: sum(pages)].to(torch.int32)
        self.indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        self.last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)],
                                 dtype=torch.int32)
        total = sum(kv_lens)
        # token t of request r sits in page ids[indptr[r] + t // page_size], row t % page_size
        request = torch.repeat_interleave(torch.arange(len(kv_lens)), torch.tensor(kv_lens))
        token = torch.arange(total) - torch.tensor([0, *kv_lens]).cumsum(0)[request]
        page = self.ids.cpu().long()[self.indptr.long()[request] + token // page_size].to(DEVICE)
        row = (token % page_size).to(DEVICE)
        self.k_pool, self.v_pool = (torch.full((pool, page_size, kv_heads, HEAD_DIM), math.nan, device=DEVICE)
                                    for _ in range(2))
        k, v = (torch.randn(total, kv_heads, HEAD_DIM, device=DEVICE, generator=gen) for _ in range(2))
        self.k_pool[page, row], self.v_pool[page, row] = k, v
        self.pages = (self.k_pool.to(dtype), self.v_pool.to(dtype))

    def dense(self, scales: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages as the kernel computes with them: rounded to the cache dtype, times the scales."""
        return tuple(x.float() * scales.get(name, 1.0) for x, name in zip(self.pages, ("k_scale", "v_scale")))

    def reference(self, q: torch.Tensor, q_len: int, scales: dict, **options):
        qo_indptr = torch.arange(len(self.kv_lens) + 1, dtype=torch.int32) * q_len
        return reference.batch_prefill_paged(q.float() * scales.get("q_scale", 1.0), self.dense(scales), qo_indptr,
                                             self.indptr, self.ids, self.last, causal=True, **options)


def _poisoned(rows: int, heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((rows, heads, HEAD_DIM), math.nan, dtype=dtype, device=DEVICE),
            torch.full((rows, heads), math.nan, device=DEVICE))


def _assert_matches(out, lse, o_ref, lse_ref, dtype) -> None:
    assert not out.isnan().any() and not lse.isnan().any(), "rows left unwritten (NaN)"
    error = (out.float() - o_ref.float()).norm() / o_ref.float().norm()
    assert error <= TOL[dtype], f"relative L2 error of o {error:.3g} > {TOL[dtype]}"
    torch.testing.assert_close(lse, lse_ref.float(), atol=2e-2, rtol=1e-3)


def _workspace() -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)


def _decode(cache: Cache, q, sinks, *, tensor_cores=False, backend="auto", q_len=1, split=None, window_left=-1,
            scales=None, out_dtype=None):
    """(o, lse) of a decode wrapper run with these sinks."""
    qo_heads, kv_heads = q.shape[1], cache.pages[0].shape[2]
    out_dtype = out_dtype or q.dtype
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace(), use_tensor_cores=tensor_cores,
                                                           backend=backend)
    wrapper.plan(cache.indptr, cache.ids, cache.last, qo_heads, kv_heads, HEAD_DIM, cache.page_size,
                 window_left=window_left, q_data_type=q.dtype, kv_data_type=cache.pages[0].dtype,
                 o_data_type=out_dtype, fixed_split_size=split, q_len_per_req=q_len)
    out, lse = _poisoned(q.shape[0], qo_heads, out_dtype)
    wrapper.run(q, cache.pages, out=out, lse=lse, return_lse=True, sinks=sinks, **(scales or {}))
    return out, lse


# ---------------------------------------------------------------------------------------
# decode


# 1000 keys split under fixed_split_size=8 (pages of 16): the merge joins that request's sinks; 3 keys:
# as many as a multi-token request's queries
DECODE_LENS = [45, 1000, 161, 3]


@pytest.mark.parametrize("kv_dtype, window_left", [(torch.bfloat16, -1), (torch.bfloat16, 128), (E4M3, -1)],
                         ids=["bf16", "bf16-window128", "e4m3"])
@pytest.mark.parametrize("split", [None, 8], ids=["planner-split", "fixed-split-8"])
def test_cuda_core_decode(kv_dtype, window_left, split):
    gen = _gen(3 + (window_left > 0) + 2 * (split is not None))
    cache = Cache(gen, DECODE_LENS, 2, 16, kv_dtype)
    q = torch.randn(len(DECODE_LENS), 8, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    sinks = _sinks(gen, 8)
    scales = KV_SCALES if kv_dtype == E4M3 else {}
    out, lse = _decode(cache, q, sinks, split=split, window_left=window_left, scales=scales)
    o_ref, lse_ref = cache.reference(q, 1, scales, window_left=window_left, sinks=sinks)
    _assert_matches(out, lse, o_ref, lse_ref, kv_dtype)


def test_cuda_core_decode_split_runs_repeat_with_sinks_and_lse():
    """One plan of a split batch, three runs with new q and sinks: the decode kernel's fused merge
    joins each run's sinks into o and lse, and leaves its counters ready for the next run."""
    gen = _gen(17)
    cache = Cache(gen, DECODE_LENS, 2, 16, torch.bfloat16)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    wrapper.plan(cache.indptr, cache.ids, cache.last, 8, 2, HEAD_DIM, cache.page_size, q_data_type=torch.bfloat16,
                 fixed_split_size=8)
    for _ in range(3):
        q = torch.randn(len(DECODE_LENS), 8, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
        sinks = _sinks(gen, 8)
        out, lse = _poisoned(len(DECODE_LENS), 8, torch.bfloat16)
        o_ret, lse_ret = wrapper.run(q, cache.pages, out=out, lse=lse, return_lse=True, sinks=sinks)
        assert o_ret.data_ptr() == out.data_ptr() and lse_ret.data_ptr() == lse.data_ptr()
        o_ref, lse_ref = cache.reference(q, 1, {}, sinks=sinks)
        _assert_matches(out, lse, o_ref, lse_ref, torch.bfloat16)


GPU_SETTINGS = settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.generate],
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@GPU_SETTINGS
@given(kv_lens=st.lists(st.integers(0, 700), min_size=1, max_size=6).filter(any), page_size=st.sampled_from([1, 5, 16]),
       group=st.sampled_from([1, 4, 8]), sink_shift=st.floats(-30, 30), split=st.sampled_from([None, 2]),
       seed=st.integers(0, 2**16))
def test_cuda_core_decode_drawn(kv_lens, page_size, group, sink_shift, split, seed):
    """Drawn batches, empty requests included (o = 0, lse = the sink), sinks far below and above the rows."""
    gen = _gen(seed)
    cache = Cache(gen, kv_lens, 2, page_size, torch.bfloat16)
    q = torch.randn(len(kv_lens), 2 * group, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    sinks = _sinks(gen, 2 * group) + sink_shift
    out, lse = _decode(cache, q, sinks, split=split)
    o_ref, lse_ref = cache.reference(q, 1, {}, sinks=sinks)
    assert not out.isnan().any() and not lse.isnan().any(), "rows left unwritten (NaN)"
    torch.testing.assert_close(out.float(), o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=2e-2, rtol=1e-3)


TENSOR_CORE_DECODES = {
    "fa2": dict(backend="fa2"),
    "fa2-multi-token": dict(backend="fa2", q_len=3),
    "fa3": dict(backend="fa3"),
    "fa3-multi-token": dict(backend="fa3", q_len=3),
    "fa3-e4m3": dict(backend="fa3", dtype=E4M3),
}


@pytest.mark.parametrize("name", sorted(TENSOR_CORE_DECODES))
@pytest.mark.parametrize("split", [None, 8], ids=["planner-split", "fixed-split-8"])
def test_tensor_core_decode(name, split):
    case = dict(TENSOR_CORE_DECODES[name])
    dtype, q_len = case.pop("dtype", torch.bfloat16), case.pop("q_len", 1)
    gen = _gen(len(name) + (split or 0))
    cache = Cache(gen, DECODE_LENS, 2, 16, dtype)
    q = torch.randn(len(DECODE_LENS) * q_len, 8, HEAD_DIM, device=DEVICE, generator=gen).to(dtype)
    sinks = _sinks(gen, 8)
    scales = dict(KV_SCALES, q_scale=0.75) if dtype == E4M3 else {}
    out, lse = _decode(cache, q, sinks, tensor_cores=True, q_len=q_len, split=split, scales=scales,
                       out_dtype=torch.bfloat16, **case)
    o_ref, lse_ref = cache.reference(q, q_len, scales, sinks=sinks)
    _assert_matches(out, lse, o_ref, lse_ref, dtype)


# ---------------------------------------------------------------------------------------
# prefill

QO_LENS, KV_LENS = [1, 37, 130, 7], [45, 300, 161, 0]  # the last request has no keys: o = 0, lse = its sink
PREFILLS = {
    "fa2-paged": dict(backend="fa2", paged=True),
    "fa2-ragged": dict(backend="fa2", paged=False),
    "fa2-paged-window": dict(backend="fa2", paged=True, window_left=48),
    "fa2-ragged-window": dict(backend="fa2", paged=False, window_left=48),
    "fa3-paged": dict(backend="fa3", paged=True),
    "fa3-ragged": dict(backend="fa3", paged=False),
    "fa3-paged-window": dict(backend="fa3", paged=True, window_left=48),
    "fa3-paged-e4m3": dict(backend="fa3", paged=True, dtype=E4M3),
    "fa3-ragged-e4m3": dict(backend="fa3", paged=False, dtype=E4M3),
}


def _prefill(name: str, split, sinks_of=lambda sinks: sinks):
    """(o, lse, o_ref, lse_ref, dtype) of a prefill case: run(sinks=sinks_of(sinks)), reference with sinks."""
    case = PREFILLS[name]
    dtype, window_left = case.get("dtype", torch.bfloat16), case.get("window_left", -1)
    gen = _gen(len(name) + (split or 0))
    cache = Cache(gen, KV_LENS, 2, 16, dtype)
    q = torch.randn(sum(QO_LENS), 8, HEAD_DIM, device=DEVICE, generator=gen).to(dtype)
    sinks = _sinks(gen, 8)
    scales = dict(KV_SCALES, q_scale=0.75) if dtype == E4M3 else {}
    qo_indptr = torch.tensor([0, *torch.tensor(QO_LENS).cumsum(0).tolist()], dtype=torch.int32)
    options = dict(causal=True, window_left=window_left, q_data_type=dtype, kv_data_type=dtype,
                   o_data_type=torch.bfloat16, fixed_split_size=split)
    out, lse = _poisoned(q.shape[0], 8, torch.bfloat16)
    if case["paged"]:
        wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(_workspace(), backend=case["backend"])
        wrapper.plan(qo_indptr, cache.indptr, cache.ids, cache.last, 8, 2, HEAD_DIM, 16, **options)
        wrapper.run(q, cache.pages, out=out, lse=lse, return_lse=True, sinks=sinks_of(sinks), **scales)
    else:
        k, v = (x.to(dtype) for x in _ragged(cache))
        wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), backend=case["backend"])
        kv_indptr = torch.tensor([0, *torch.tensor(KV_LENS).cumsum(0).tolist()], dtype=torch.int32)
        wrapper.plan(qo_indptr, kv_indptr, 8, 2, HEAD_DIM, **options)
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True, sinks=sinks_of(sinks), **scales)
    dense = cache.dense(scales)
    o_ref, lse_ref = reference.batch_prefill_paged(q.float() * scales.get("q_scale", 1.0), dense, qo_indptr,
                                                   cache.indptr, cache.ids, cache.last, causal=True,
                                                   window_left=window_left, sinks=sinks)
    return out, lse, o_ref, lse_ref, dtype


def _ragged(cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's tokens as ragged [total_kv, heads, dim] fp32 k and v."""
    ks, vs = reference.gather_dense_kv((cache.k_pool, cache.v_pool), cache.indptr, cache.ids, cache.last)
    return torch.cat(ks).contiguous(), torch.cat(vs).contiguous()


@pytest.mark.parametrize("name", sorted(PREFILLS))
@pytest.mark.parametrize("split", [None, 4], ids=["planner-split", "fixed-split-4"])
def test_prefill(name, split):
    out, lse, o_ref, lse_ref, dtype = _prefill(name, split)
    _assert_matches(out, lse, o_ref, lse_ref, dtype)


# ---------------------------------------------------------------------------------------
# metamorphic


@pytest.mark.parametrize("split", [None, 8], ids=["planner-split", "fixed-split-8"])
def test_sinks_of_minus_inf_are_no_sinks(split):
    """A sink of -inf joins with scale exactly 1 and leaves lse as it was: bit-identical outputs."""
    gen = _gen(11)
    cache = Cache(gen, DECODE_LENS, 2, 16, torch.bfloat16)
    q = torch.randn(len(DECODE_LENS), 8, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    minus_inf = torch.full((8,), -math.inf, device=DEVICE)
    for tensor_cores in (False, True):
        with_inf = _decode(cache, q, minus_inf, tensor_cores=tensor_cores, split=split)
        without = _decode(cache, q, None, tensor_cores=tensor_cores, split=split)
        assert torch.equal(with_inf[0], without[0]) and torch.equal(with_inf[1], without[1])
    for name in ("fa2-ragged", "fa3-paged"):
        with_inf = _prefill(name, split, lambda sinks: torch.full_like(sinks, -math.inf))
        without = _prefill(name, split, lambda sinks: None)
        assert torch.equal(with_inf[0], without[0]) and torch.equal(with_inf[1], without[1])


def test_lse_counts_the_sink():
    """2^lse with a sink = 2^lse without + e^sink, row by row (and o shrinks by their ratio)."""
    gen = _gen(12)
    cache = Cache(gen, DECODE_LENS, 2, 16, torch.bfloat16)
    q = torch.randn(len(DECODE_LENS), 8, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    sinks = _sinks(gen, 8)
    o_with, lse_with = _decode(cache, q, sinks, split=8)
    o_without, lse_without = _decode(cache, q, None, split=8)
    expected = torch.logaddexp2(lse_without, sinks / math.log(2)).expand_as(lse_with)
    torch.testing.assert_close(lse_with, expected, atol=1e-3, rtol=1e-4)
    ratio = torch.exp2(lse_without - lse_with)[..., None]
    torch.testing.assert_close(o_with.float(), o_without.float() * ratio, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_decode_equals_one_token_prefill(backend):
    """Decode with sinks (CUDA cores, and tensor cores on `backend`) equals paged prefill with one query
    token per request and the same sinks."""
    gen = _gen(13)
    cache = Cache(gen, DECODE_LENS, 2, 16, torch.bfloat16)
    q = torch.randn(len(DECODE_LENS), 8, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    sinks = _sinks(gen, 8)
    wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(_workspace(), backend=backend)
    wrapper.plan(torch.arange(len(DECODE_LENS) + 1, dtype=torch.int32), cache.indptr, cache.ids, cache.last, 8, 2,
                 HEAD_DIM, 16, causal=True, q_data_type=torch.bfloat16)
    o_prefill, lse_prefill = wrapper.run(q, cache.pages, return_lse=True, sinks=sinks)
    for tensor_cores in (False, True):
        o, lse = _decode(cache, q, sinks, tensor_cores=tensor_cores, backend=backend if tensor_cores else "auto")
        torch.testing.assert_close(o.float(), o_prefill.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, lse_prefill, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_cuda_graph_replay_reads_the_sinks_of_the_replay(tensor_cores):
    """The captured launch records the sinks' address; a replay reads what that tensor holds then."""
    gen = _gen(14)
    cache = Cache(gen, DECODE_LENS, 2, 16, torch.bfloat16)
    batch = len(DECODE_LENS)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(), use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indices_buffer=torch.empty(cache.ids.numel(), dtype=torch.int32, device=DEVICE),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=DEVICE))
    # the planner splits the 1000-key request of this small batch; the merge runs under graphs anyway
    wrapper.plan(cache.indptr, cache.ids, cache.last, 8, 2, HEAD_DIM, 16, q_data_type=torch.bfloat16)
    q = torch.randn(batch, 8, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    sinks = _sinks(gen, 8)
    out, lse = _poisoned(batch, 8, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapper.run(q, cache.pages, out=out, lse=lse, return_lse=True, sinks=sinks)  # warm-up, outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, cache.pages, out=out, lse=lse, return_lse=True, sinks=sinks)
    for step in range(2):
        sinks.copy_(_sinks(gen, 8) + 4 * step)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = cache.reference(q, 1, {}, sinks=sinks)
        _assert_matches(out, lse, o_ref, lse_ref, torch.bfloat16)


def test_run_names_bad_sinks():
    """run() checks sinks as it checks q: the argument, what was expected and what was given."""
    gen = _gen(15)
    cache = Cache(gen, [40, 7], 2, 16, torch.bfloat16)
    q = torch.randn(2, 8, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    wrapper.plan(cache.indptr, cache.ids, cache.last, 8, 2, HEAD_DIM, 16, q_data_type=torch.bfloat16)
    for bad, words in [(torch.zeros(8, device=DEVICE, dtype=torch.bfloat16), ("torch.float32", "torch.bfloat16")),
                       (torch.zeros(4, device=DEVICE), ("(8,)", "[num_qo_heads]", "(4,)")),
                       (torch.zeros(8), ("cuda", "cpu")),
                       (torch.zeros(16, device=DEVICE)[::2], ("contiguous",))]:
        with pytest.raises(ValueError) as info:
            wrapper.run(q, cache.pages, sinks=bad)
        assert str(info.value).startswith("sinks:") and all(w in str(info.value) for w in words), str(info.value)
    wrapper.run(q, cache.pages, sinks=torch.zeros(8, device=DEVICE))  # a good one after bad ones
