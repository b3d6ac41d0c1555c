"""FA2 batch prefill on the GPU against attnforge.reference, plus metamorphic checks.

Shapes are drawn with hypothesis; kernel specs come from the short MODULES list (each build
costs GPU-machine time). Everything that is a run-time argument varies: batch, ragged q and kv
lengths, causal, page size, page table, layout, GQA group, window size, cap value, mask bits.
Outputs are poisoned with NaN first; inputs are randn. An fp8 KV cache (e4m3 / e5m2 with a bf16/fp16
query) is fp32 randn rounded to fp8, run with drawn k_scale / v_scale; its reference is fed the
dequantized cache (fp8 value * scale, fp32), exactly the values the kernel must compute with.
Cases, runs and checks: prefill_cases.py; what only fa3 has (persistent CTAs, pages gathered ahead,
DeepSeek dims): test_prefill_fa3_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import attnforge
from attnforge import reference

from prefill_cases import (Batch, Case, DEVICE, E4M3, E5M2, FA3, FP8, LSE_TOL, Module, O_TOL, PLAIN, VARIANTS,
                           WORKSPACE, assert_fp8_error_within_bounds, assert_matches_reference, build, cases,
                           error_stats, gpu_settings, indptr_of, run_ours, run_reference)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("modules", [PLAIN, VARIANTS, FA3, FP8], ids=["plain", "variants", "fa3", "fp8_kv"])
def test_prefill_matches_reference(modules):
    @gpu_settings(max_examples=30)
    @given(cases(modules))
    def check(case):
        note(repr(case))
        batch = build(case)
        out, lse = run_ours(case, batch)
        assert_matches_reference(case, out, lse, *run_reference(case, batch))
        if case.module.fp8_kv:
            assert_fp8_error_within_bounds(case, batch, out)

    check()


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "ragged"])
@pytest.mark.parametrize("kv_len", [512, 4096, 16384])
@pytest.mark.parametrize("module", FP8[:2], ids=lambda m: f"{m.dtype}-{m.fp8_kv}")
def test_fp8_kv_error_statistics_by_context_length(module, kv_len, paged, capsys):
    """Error of one fixed causal batch per context length, printed (shown even without -s) for the
    issue's report and bounded like the drawn cases."""
    case = Case(module, qo_lens=[256, 1, 1000], kv_lens=[kv_len] * 3, causal=True, paged=paged, layout="NHD",
                page_size=16, num_kv_heads=2, group=4, seed=kv_len, k_scale=2.5, v_scale=0.75)
    batch = build(case)
    out, lse = run_ours(case, batch)
    assert_matches_reference(case, out, lse, *run_reference(case, batch))
    rel_l2, max_abs = assert_fp8_error_within_bounds(case, batch, out)
    with capsys.disabled():
        print(f"\n[fp8 kv prefill] {module.dtype} {module.fp8_kv} kv_len={kv_len} paged={paged}: "
              f"o relative L2 {rel_l2:.3e}, max abs {max_abs:.3e}")


@gpu_settings(max_examples=10)
@given(cases(FP8[:2]))
def test_fp8_cache_as_accurate_as_its_exact_16bit_copy(case):
    """fp8 values are exact in fp16 and in the query's 16-bit dtype. The fp8 module widens them to
    fp16 in registers (its q in fp16 too, a bf16 one times a power of two, dims reordered), so against
    the fp32 reference it must be as accurate as the 16-bit module on the cache's 16-bit copy (same
    k_scale, folded into the same sm_scale), and agree with it within the output's rounding. Split-KV
    is off so both plans are the same whatever each module's occupancy; v_scale is left out (the same
    multiply after either)."""
    case.v_scale = None
    note(repr(case))
    batch = build(case)
    out8, lse8 = run_ours(case, batch, disable_split_kv=True)
    m16 = Module(case.module.dtype)
    assert m16.head_dim_qk == m16.head_dim_vo == case.module.head_dim_qk, "caches convert without a V view"
    batch16 = Batch(**{**batch.__dict__, "k": batch.k.to(m16.dtype), "v": batch.v.to(m16.dtype),
                       "cache": tuple(c.to(m16.dtype) for c in batch.cache)})
    out16, lse16 = run_ours(Case(**{**case.__dict__, "module": m16}), batch16, disable_split_kv=True)
    o_ref, _ = run_reference(case, batch, o_dtype=torch.float32)
    rel_l2_8, rel_l2_16 = error_stats(out8, o_ref)[0], error_stats(out16, o_ref)[0]
    note(f"relative L2: fp8 module {rel_l2_8:.3e}, 16-bit module {rel_l2_16:.3e}")
    assert rel_l2_8 <= 1.15 * rel_l2_16 + 1e-6, f"fp8 module {rel_l2_8:.3e} vs 16-bit module {rel_l2_16:.3e}"
    torch.testing.assert_close(out8.float(), out16.float(), **O_TOL[m16.dtype])
    # The denominator sums the 16-bit P that multiplies V (fp16 in the fp8 module, the query's dtype in
    # the other), each term within its type's unit roundoff u: the base-2 lses differ by <= (u + u) / ln 2.
    unit_roundoff = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
    bound = (unit_roundoff[torch.float16] + unit_roundoff[m16.dtype]) / math.log(2)
    torch.testing.assert_close(lse8, lse16, atol=bound, rtol=0)


@pytest.mark.parametrize("q_exponent", [20, -24])
def test_fp8_cache_with_a_bf16_query_outside_fp16_range(q_exponent):
    """Over an fp8 cache the kernel runs fp16 MMAs, a bf16 q brought into fp16's range by a power of
    two per CTA. q times 2^e with k_scale 2^-e (the same scores) must still match the reference when q
    lies far above fp16's largest value (2^20 x randn) or far below its smallest normal (2^-24)."""
    case = Case(FP8[0], qo_lens=[300, 1, 77], kv_lens=[1000, 2000, 77], causal=True, paged=True, layout="NHD",
                page_size=16, num_kv_heads=2, group=4, seed=7, k_scale=2.0 ** -q_exponent, v_scale=0.5)
    batch = build(case)
    batch.q.mul_(2.0 ** q_exponent)  # exact: a power of two, inside bf16's range
    out, lse = run_ours(case, batch)
    assert_matches_reference(case, out, lse, *run_reference(case, batch))
    assert_fp8_error_within_bounds(case, batch, out)


@gpu_settings(max_examples=12)
@given(cases([PLAIN[0], FA3[0]], max_batch=3, max_qo=64, token_budget=60000))
def test_split_kv_equals_unsplit(case):
    """Few requests with long KV get split; forcing it off must not change the answer."""
    note(repr(case))
    batch = build(case)
    split = run_ours(case, batch, fixed_split_size=max(1, 256 // case.page_size) if case.paged else None)
    whole = run_ours(case, batch, disable_split_kv=True)
    torch.testing.assert_close(split[0].float(), whole[0].float(), **O_TOL[case.module.dtype])
    seen = torch.isfinite(whole[1])
    torch.testing.assert_close(split[1][seen], whole[1][seen], **LSE_TOL)


@gpu_settings(max_examples=10)
@given(cases([PLAIN[0], FA3[0]]))
def test_gqa_equals_repeated_kv_heads(case):
    note(repr(case))
    batch = build(case)
    out, lse = run_ours(case, batch)
    repeated = Case(**{**case.__dict__, "num_kv_heads": case.num_qo_heads, "group": 1})
    dim = 1 if case.layout == "NHD" else 0
    rep = Batch(**{**batch.__dict__, "k": batch.k.repeat_interleave(case.group, dim),
                   "v": batch.v.repeat_interleave(case.group, dim)})
    rep.cache = tuple(c.repeat_interleave(case.group, 2 if case.layout == "NHD" else 1) for c in batch.cache)
    out2, lse2 = run_ours(repeated, rep)
    # The group changes the packed rows, hence the q tile and the kv chunking: same maths, other
    # summation order, so equal up to the output rounding.
    torch.testing.assert_close(out.float(), out2.float(), **O_TOL[case.module.dtype])
    torch.testing.assert_close(lse, lse2, **LSE_TOL)


@gpu_settings(max_examples=8)
@given(cases([PLAIN[0], FA3[0]]), st.integers(0, 2**31 - 1))
def test_page_table_permutation_leaves_output_unchanged(case, seed):
    case.paged = True
    batch = build(case)
    out, lse = run_ours(case, batch)
    perm = torch.randperm(batch.cache[0].shape[0], device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed))
    moved = tuple(torch.empty_like(c).index_copy_(0, perm, c) for c in batch.cache)
    out2, lse2 = run_ours(case, Batch(**{**batch.__dict__, "cache": moved, "page_ids": perm[batch.page_ids.long()].int()}))
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse2, atol=0, rtol=0)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, E4M3, E5M2], ids=["bf16", "e4m3", "e5m2"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_tensor_core_decode_equals_cuda_core_decode(group, kv_dtype):
    """Decode on the prefill kernels equals the CUDA-core decode kernel on the same cache (an fp8
    one with k_scale / v_scale too)."""
    gen = torch.Generator(device=DEVICE).manual_seed(group)
    batch, kv_heads, ps, dim = 33, 4, 16, 128
    kv_lens = torch.randint(1, 3000, (batch,), generator=torch.Generator().manual_seed(group)).tolist()
    pages = [math.ceil(n / ps) for n in kv_lens]
    pool = sum(pages) + 5
    cache = tuple(torch.randn(pool, ps, kv_heads, dim, device=DEVICE, generator=gen).to(kv_dtype) for _ in "kv")
    page_ids = torch.randperm(pool, device=DEVICE, generator=gen)[: sum(pages)].int()
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    q = torch.randn(batch, kv_heads * group, dim, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    scales = dict(k_scale=0.4, v_scale=2.5) if kv_dtype.itemsize == 1 else {}
    results = []
    for tensor_cores in (False, True):
        wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                               use_tensor_cores=tensor_cores)
        wrapper.plan(indptr_of(pages), page_ids, last, kv_heads * group, kv_heads, dim, ps, q_data_type=torch.bfloat16,
                     kv_data_type=kv_dtype)
        out = torch.full_like(q, math.nan)
        results.append(wrapper.run(q, cache, out=out, return_lse=True, **scales))
    assert not results[1][0].isnan().any(), "NaN in the tensor-core decode output"
    torch.testing.assert_close(results[0][0].float(), results[1][0].float(), **O_TOL[torch.bfloat16])
    torch.testing.assert_close(results[0][1], results[1][1], **LSE_TOL)


@pytest.mark.parametrize("module", [PLAIN[0], FA3[0]], ids=["fa2", "fa3"])
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("kv_len", [200, 256, 1000])
def test_rows_outside_a_request_never_reach_it(module, paged, kv_len):
    """Tiles read past a request's last key (the next request's ragged rows, the unused tail of
    its last page) must not reach its output, even when those rows hold NaN."""
    case = Case(module, qo_lens=[300, 7], kv_lens=[kv_len, 90], causal=False, paged=paged, layout="NHD",
                page_size=16, num_kv_heads=2, group=4, seed=kv_len)
    batch = build(case)
    o_ref, lse_ref = run_reference(case, batch)
    first_kv = case.kv_lens[0]
    batch.k[first_kv:], batch.v[first_kv:] = math.nan, math.nan
    for cache in batch.cache:  # NaN everywhere but request 0's keys
        keep = cache[batch.page_ids[: batch.page_indptr[1]].long()].clone()
        cache.fill_(math.nan)
        cache[batch.page_ids[: batch.page_indptr[1]].long()] = keep
        tail = cache[batch.page_ids[batch.page_indptr[1] - 1].long()]
        tail[int(batch.last_page_len[0]):] = math.nan
    out, lse = run_ours(case, batch)
    rows = case.qo_lens[0]
    assert_matches_reference(case, out[:rows], lse[:rows], o_ref[:rows], lse_ref[:rows])


def test_causal_rows_before_their_keys_see_nothing():
    """qo_len > kv_len with causal: the first rows see no key (o = 0, lse = -inf), as FlashInfer."""
    case = Case(Module(), qo_lens=[40], kv_lens=[25], causal=True, paged=False, layout="NHD", page_size=1,
                num_kv_heads=2, group=2)
    batch = build(case)
    out, lse = run_ours(case, batch)
    assert torch.equal(out[:15].float(), torch.zeros_like(out[:15].float()))
    assert torch.isneginf(lse[:15]).all()
    assert_matches_reference(case, out, lse, *run_reference(case, batch))


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("qo_len", [1, 37, 200])
def test_rising_scores_match_reference(qo_len, causal, backend):
    """Keys whose scores grow along the sequence, a little per tile and then in one late jump: fa3
    keeps a row's running max until a tile exceeds it by more than its lag (o is rescaled only
    then). o and lse must still be the reference's, for a decode row, a partial q tile and two."""
    case = Case(Module(backend=backend), qo_lens=[qo_len], kv_lens=[3000], causal=causal, paged=False, layout="NHD",
                page_size=16, num_kv_heads=4, group=1, seed=qo_len)
    batch = build(case)
    growth = torch.linspace(0.2, 3.0, case.kv_lens[0], device=DEVICE)
    growth[-100:] = 6.0  # the max jumps by far more than any lag
    batch.k.mul_(growth[:, None, None])
    out, lse = run_ours(case, batch)
    assert_matches_reference(case, out, lse, *run_reference(case, batch))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
def test_single_prefill_matches_reference(kv_dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(300, 8, 128, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    k, v = (torch.randn(700, 2, 128, device=DEVICE, generator=gen).to(kv_dtype) for _ in "kv")
    scale_k, scale_v = (0.5, 3.0) if kv_dtype.itemsize == 1 else (None, None)
    out, lse = attnforge.single_prefill_with_kv_cache(q, k, v, scale_k=scale_k, scale_v=scale_v, causal=True,
                                                      return_lse=True)
    o_ref, lse_ref = reference.single_prefill(q, k.float() * (scale_k or 1.0), v.float() * (scale_v or 1.0),
                                              causal=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), o_ref.float(), **O_TOL[torch.bfloat16])
    torch.testing.assert_close(lse, lse_ref, **LSE_TOL)


def test_fp8_kv_run_refuses_a_tensor_scale():
    """The fa2 kernels take float calibration scales; a tensor one (fa3 fp8's) is refused by name
    rather than read on the host (a device sync) or ignored."""
    indptr = torch.tensor([0, 4], dtype=torch.int32)
    wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE))
    wrapper.plan(indptr, indptr, 8, 2, 128, q_data_type=torch.bfloat16, kv_data_type=E4M3)
    q = torch.randn(4, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(4, 2, 128, device=DEVICE).to(E4M3) for _ in "kv")
    with pytest.raises(ValueError, match="k_scale.*tensor"):
        wrapper.run(q, k, v, k_scale=torch.tensor(2.0, device=DEVICE))


@gpu_settings(max_examples=6)
@given(cases(PLAIN[:1], max_batch=6, max_qo=300, token_budget=6000), st.data())
def test_cuda_graph_replays_after_replan(case, data):
    """Capture run() once (ragged), then re-plan with other lengths (same batch size, no more
    query tokens) and replay: plan() may only change buffer contents, never what was captured."""
    case.paged, case.layout = False, "NHD"
    qo2 = [data.draw(st.integers(1 if case.causal else 0, q), label=f"qo_len {i} of the second plan")
           for i, q in enumerate(case.qo_lens)]
    kv2 = [data.draw(st.integers(max(q, 1), kv), label=f"kv_len {i} of the second plan")
           for i, (q, kv) in enumerate(zip(qo2, case.kv_lens))]
    second = Case(**{**case.__dict__, "qo_lens": qo2, "kv_lens": kv2, "seed": case.seed + 1})
    note(f"{case!r}\nsecond plan: qo_lens={qo2} kv_lens={kv2}")
    first_batch, second_batch = build(case), build(second)
    q = first_batch.q.clone()
    k, v = first_batch.k.clone(), first_batch.v.clone()
    out = torch.empty(q.shape[0], case.num_qo_heads, case.module.head_dim_vo, dtype=q.dtype, device=DEVICE)
    lse = torch.empty(out.shape[:2], dtype=torch.float32, device=DEVICE)
    wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                             use_cuda_graph=True)

    def plan(c: Case, b: Batch) -> None:
        wrapper.plan(b.qo_indptr, b.kv_indptr, c.num_qo_heads, c.num_kv_heads, c.module.head_dim_qk,
                     causal=c.causal, q_data_type=c.module.dtype)

    plan(case, first_batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)

    for c, b in ((case, first_batch), (second, second_batch)):
        if b is not first_batch:
            plan(c, b)
        rows, kv_rows = b.q.shape[0], b.k.shape[0]
        q[:rows].copy_(b.q)
        k[:kv_rows].copy_(b.k)
        v[:kv_rows].copy_(b.v)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(c, out[:rows], lse[:rows], *run_reference(c, b))
