"""FA2 batch prefill on the GPU against attnforge.reference, plus metamorphic checks.

Shapes are drawn with hypothesis; kernel specs come from the short MODULES list (each build
costs GPU-machine time). Everything that is a run-time argument varies: batch, ragged q and kv
lengths, causal, page size, page table, layout, GQA group, window size, cap value, mask bits.
Outputs are poisoned with NaN first; inputs are randn. An fp8 KV cache (e4m3 / e5m2 with a bf16/fp16
query) is fp32 randn rounded to fp8, run with drawn k_scale / v_scale; its reference is fed the
dequantized cache (fp8 value * scale, fp32), exactly the values the kernel must compute with.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import attnforge
from attnforge import reference
from attnforge.codegen.abi import PLAN_HEADER

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
WORKSPACE = 256 << 20
O_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}
LSE_TOL = dict(atol=1e-2, rtol=1e-3)
# fp8 KV, o vs the fp32 reference: the kernel computes with the exact fp8 values, so what is left is
# the 16-bit rounding of P and of o, plus one more of o by v_scale after the kernel. Relative L2 a few
# times the output's rounding (2^-9 bf16, 2^-12 fp16, rms); max abs at most two ulps of the largest
# dequantized V value, which bounds |o| and the rounding of P.V.
FP8_REL_L2_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
FP8_MAX_ABS_ULPS = 2


def gpu_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


@dataclass(frozen=True)
class Module:
    dtype: torch.dtype = torch.bfloat16
    head_dim_qk: int = 128
    head_dim_vo: int = 128
    soft_cap: bool = False
    window: bool = False
    mask: bool = False
    pos: str = "NONE"
    backend: str = "fa2"
    fp8_kv: torch.dtype | None = None  # the KV cache's fp8 dtype; None: the query's dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.fp8_kv or self.dtype


PLAIN = [Module(), Module(head_dim_qk=64, head_dim_vo=64), Module(head_dim_qk=256, head_dim_vo=256),
         Module(torch.float16), Module(head_dim_qk=192)]
VARIANTS = [Module(window=True), Module(head_dim_qk=256, head_dim_vo=256, soft_cap=True, window=True),
            Module(mask=True), Module(pos="ROPE_LLAMA"), Module(pos="ALIBI")]
FA3 = [Module(backend="fa3"), Module(torch.float16, 64, 64, backend="fa3"), Module(head_dim_qk=256, head_dim_vo=256,
       backend="fa3"), Module(window=True, soft_cap=True, backend="fa3"), Module(head_dim_qk=192, backend="fa3")]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [Module(fp8_kv=E4M3), Module(torch.float16, fp8_kv=E5M2), Module(fp8_kv=E5M2, head_dim_qk=64, head_dim_vo=64),
       Module(fp8_kv=E4M3, head_dim_qk=256, head_dim_vo=256), Module(fp8_kv=E4M3, head_dim_qk=192)]


@dataclass
class Case:
    module: Module
    qo_lens: list[int]
    kv_lens: list[int]
    causal: bool
    paged: bool
    layout: str
    page_size: int
    num_kv_heads: int
    group: int
    window_left: int = -1
    soft_cap: float | None = None
    seed: int = 0
    k_scale: float | None = None  # run()'s calibration scales (fp8 modules only)
    v_scale: float | None = None

    @property
    def num_qo_heads(self) -> int:
        return self.num_kv_heads * self.group


@st.composite
def cases(draw, modules, max_batch: int = 8, max_qo: int = 2048, max_kv: int = 16384, token_budget: int = 40000):
    module = draw(st.sampled_from(modules))
    batch = draw(st.integers(1, max_batch))
    causal = not module.mask and draw(st.booleans())
    regime = draw(st.sampled_from(["short", "short", "medium", "long"]))
    kv_hi = min({"short": 300, "medium": 4096, "long": max_kv}[regime], max(1, token_budget // batch))
    kv_lens = draw(st.lists(st.integers(1, kv_hi), min_size=batch, max_size=batch))
    qo_lens = [draw(st.integers(0 if i and draw(st.booleans()) and not causal else 1, min(kv, max_qo)))
               for i, kv in enumerate(kv_lens)]
    return Case(
        module=module, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal, paged=draw(st.booleans()),
        layout=draw(st.sampled_from(["NHD", "HND"])), page_size=draw(st.sampled_from([1, 5, 8, 16, 64, 256])),
        num_kv_heads=draw(st.sampled_from([1, 2, 4])), group=draw(st.sampled_from([1, 2, 4, 5, 8])),
        window_left=draw(st.integers(0, 512)) if module.window else -1,
        soft_cap=draw(st.sampled_from([5.0, 30.0])) if module.soft_cap else None, seed=draw(st.integers(0, 2**31 - 1)),
        k_scale=draw(FP8_SCALES) if module.fp8_kv else None, v_scale=draw(FP8_SCALES) if module.fp8_kv else None)


FP8_SCALES = st.sampled_from([None, 1.0, 0.25, 2.5])


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor  # ragged NHD/HND
    v: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    cache: tuple
    page_indptr: torch.Tensor
    page_ids: torch.Tensor
    last_page_len: torch.Tensor
    mask: torch.Tensor | None  # flat bool, sum(qo_len * kv_len)


def indptr_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def build(case: Case) -> Batch:
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    m = case.module
    total_q, total_kv = sum(case.qo_lens), sum(case.kv_lens)

    def randn(*shape, dtype=m.dtype):
        return torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)

    # an fp8 cache: fp32 randn, rounded to fp8 once the pages are laid out (fp8 subnormals included)
    kv_values = torch.float32 if m.fp8_kv else m.dtype
    q = randn(total_q, case.num_qo_heads, m.head_dim_qk)
    k_nhd = randn(total_kv, case.num_kv_heads, m.head_dim_qk, dtype=kv_values)
    v_nhd = randn(total_kv, case.num_kv_heads, m.head_dim_vo, dtype=kv_values)
    ps = case.page_size
    pages = [math.ceil(n / ps) for n in case.kv_lens]
    pool = sum(pages) + 3
    page_ids = torch.randperm(pool, device=DEVICE, generator=gen)[: sum(pages)].to(torch.int32)
    caches = []
    for dense, dim in ((k_nhd, m.head_dim_qk), (v_nhd, m.head_dim_vo)):
        # V pages share K's shape (and so its strides) and are viewed down to head_dim_vo
        paged = randn(pool, ps, case.num_kv_heads, m.head_dim_qk, dtype=kv_values)
        start, page = 0, 0
        for n, p in zip(case.kv_lens, pages):
            for j in range(p):
                rows = dense[start + j * ps: start + min(n, (j + 1) * ps)]
                paged[int(page_ids[page + j]), : rows.shape[0], :, :dim] = rows
            start, page = start + n, page + p
        caches.append((paged if case.layout == "NHD" else paged.transpose(1, 2).contiguous()).to(m.kv_dtype)[..., :dim])
    k, v = (k_nhd, v_nhd) if case.layout == "NHD" else (k_nhd.transpose(0, 1).contiguous(),
                                                         v_nhd.transpose(0, 1).contiguous())
    k, v = k.to(m.kv_dtype), v.to(m.kv_dtype)
    mask = None
    if m.mask:
        mask = torch.rand(sum(a * b for a, b in zip(case.qo_lens, case.kv_lens)), device=DEVICE, generator=gen) < 0.6
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(case.kv_lens, pages)], dtype=torch.int32)
    return Batch(q, k, v, indptr_of(case.qo_lens), indptr_of(case.kv_lens), tuple(caches), indptr_of(pages),
                 page_ids, last, mask)


def options(case: Case) -> dict:
    return dict(causal=case.causal, window_left=case.window_left, logits_soft_cap=case.soft_cap,
                pos_encoding_mode=case.module.pos)


def run_ours(case: Case, batch: Batch, **plan_extra):
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    m = case.module
    common = dict(head_dim_vo=m.head_dim_vo, custom_mask=batch.mask, q_data_type=m.dtype, kv_data_type=m.kv_dtype,
                  **options(case), **plan_extra)
    scales = dict(k_scale=case.k_scale, v_scale=case.v_scale)
    backend = dict(backend=m.backend)
    out = torch.full((batch.q.shape[0], case.num_qo_heads, m.head_dim_vo), math.nan, dtype=m.dtype, device=DEVICE)
    lse = torch.full(out.shape[:2], math.nan, dtype=torch.float32, device=DEVICE)
    if case.paged:
        wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout=case.layout, **backend)
        wrapper.plan(batch.qo_indptr, batch.page_indptr, batch.page_ids, batch.last_page_len, case.num_qo_heads,
                     case.num_kv_heads, m.head_dim_qk, case.page_size, **common)
        wrapper.run(batch.q, batch.cache, out=out, lse=lse, return_lse=True, **scales)
    else:
        wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout=case.layout, **backend)
        wrapper.plan(batch.qo_indptr, batch.kv_indptr, case.num_qo_heads, case.num_kv_heads, m.head_dim_qk, **common)
        wrapper.run(batch.q, batch.k, batch.v, out=out, lse=lse, return_lse=True, **scales)
    return out, lse


def dequantized(case: Case, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 K/V as the fp32 values it stands for (fp8 value * scale); a 16-bit K/V as is."""
    if case.module.fp8_kv is None:
        return k, v
    return k.float() * (case.k_scale or 1.0), v.float() * (case.v_scale or 1.0)


def run_reference(case: Case, batch: Batch, o_dtype=None):
    packed, mask_indptr = None, None
    if batch.mask is not None:
        bits = indptr_of([a * b for a, b in zip(case.qo_lens, case.kv_lens)])
        packed, mask_indptr = attnforge.segment_packbits(batch.mask, bits.to(DEVICE), bitorder="little")
    k, v = dequantized(case, batch.k, batch.v)
    if case.layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    return reference.batch_prefill_ragged(batch.q, k, v, batch.qo_indptr, batch.kv_indptr, packed_custom_mask=packed,
                                          mask_indptr=mask_indptr, o_dtype=o_dtype, **options(case))


def assert_matches_reference(case: Case, out, lse, o_ref, lse_ref):
    assert not out.isnan().any(), "NaN in o (unwritten or poisoned output)"
    torch.testing.assert_close(out.float(), o_ref.float(), **O_TOL[case.module.dtype])
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), seen), "lse is -inf exactly where a row sees no key"
    torch.testing.assert_close(lse[seen], lse_ref[seen], **LSE_TOL)


def error_stats(out: torch.Tensor, o_ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max abs) error of o against the fp32 reference."""
    diff = out.float() - o_ref
    return (diff.norm() / o_ref.norm().clamp_min(1e-30)).item(), diff.abs().max().item()


def assert_fp8_error_within_bounds(case: Case, batch: Batch, out: torch.Tensor) -> tuple[float, float]:
    o_ref, _ = run_reference(case, batch, o_dtype=torch.float32)
    rel_l2, max_abs = error_stats(out, o_ref)
    v_max = dequantized(case, batch.k, batch.v)[1].abs().max().item()
    assert rel_l2 <= FP8_REL_L2_TOL[case.module.dtype], f"relative L2 error {rel_l2:.3e}"
    assert max_abs <= FP8_MAX_ABS_ULPS * torch.finfo(case.module.dtype).eps * v_max, \
        f"max abs error {max_abs:.3e} (max |v| {v_max:.3g})"
    return rel_l2, max_abs


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


@pytest.mark.parametrize("page_size", [16, 5], ids=["boxed", "gathered"])
def test_fa3_deepseek_head_dims_match_reference(page_size):
    """fa3 at (qk 192, vo 128): K rows of 24 16-byte cells, by TMA boxes (page 16) and by the
    cell-by-cell gather (pages of 5 rows, and every request's last tile)."""
    case = Case(Module(head_dim_qk=192, backend="fa3"), qo_lens=[300, 7], kv_lens=[1000, 90], causal=True, paged=True,
                layout="NHD", page_size=page_size, num_kv_heads=2, group=4, seed=page_size)
    batch = build(case)
    out, lse = run_ours(case, batch)
    assert_matches_reference(case, out, lse, *run_reference(case, batch))


def many_jobs_case(module: Module, causal: bool, seed: int) -> Case:
    """Far more (work item, kv head) jobs than the H200's 132 SMs, so each persistent fa3 CTA runs
    a dozen or more: lengths from one token to several tiles, requests without queries (no job of
    theirs has kv tiles), pages of 16 rows (boxed) with gathered last tiles."""
    rng = torch.Generator().manual_seed(seed)
    kv_lens = torch.randint(1, 1500, (40,), generator=rng).tolist()
    qo_lens = [min(kv, int(q)) for kv, q in zip(kv_lens, torch.randint(1, 400, (40,), generator=rng))]
    if not causal:
        qo_lens[3] = qo_lens[17] = 0
    return Case(module, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal, paged=True, layout="NHD", page_size=16,
                num_kv_heads=4, group=4, seed=seed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("module", FA3[:3], ids=["hd128", "hd64-fp16", "hd256"])
def test_fa3_persistent_ctas_match_reference(module, causal):
    """Each persistent CTA runs one job after another: its K/V stages, phases and Q buffer carry
    over from job to job, and the producer loads the next job while the consumers store this one.
    Also few q tiles split into 64-token chunks (split-KV): over a thousand short jobs, and under
    causal many without kv tiles (chunks past a tile's diagonal) among the others."""
    many = many_jobs_case(module, causal, seed=11 + causal)
    split = Case(module, qo_lens=[300, 1, 7], kv_lens=[1400, 900, 1100], causal=causal, paged=True, layout="NHD",
                 page_size=16, num_kv_heads=4, group=4, seed=3)
    for case, extra in ((many, {}), (split, {"fixed_split_size": 4})):
        batch = build(case)
        out, lse = run_ours(case, batch, **extra)
        assert_matches_reference(case, out, lse, *run_reference(case, batch))


def test_fa3_job_counter_is_zero_after_every_run():
    """CTAs take jobs from a counter in the plan image; the launch leaves it at 0, so the next
    run() (or a CUDA graph's replay) of the same plan runs every job again."""
    case = many_jobs_case(FA3[0], causal=True, seed=2)
    case.paged = False
    batch = build(case)
    o_ref, lse_ref = run_reference(case, batch)
    wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                             backend="fa3")
    wrapper.plan(batch.qo_indptr, batch.kv_indptr, case.num_qo_heads, case.num_kv_heads, 128, causal=True,
                 q_data_type=case.module.dtype)
    for _ in range(3):
        out = torch.full((batch.q.shape[0], case.num_qo_heads, 128), math.nan, dtype=case.module.dtype, device=DEVICE)
        out, lse = wrapper.run(batch.q, batch.k, batch.v, out=out, return_lse=True)
        assert_matches_reference(case, out, lse, o_ref, lse_ref)
        assert wrapper._image.read_slot(PLAN_HEADER.index("job_counter")) == 0


def rows_of_others(batch: Batch, request: int) -> torch.Tensor:
    """Every q row but `request`'s, as a bool mask over o's rows."""
    rows = batch.qo_indptr.tolist()
    others = torch.ones(rows[-1], dtype=torch.bool, device=DEVICE)
    others[rows[request]:rows[request + 1]] = False
    return others


@pytest.mark.parametrize("gather", [False, True], ids=["pages_read", "pages_gathered"])
def test_fa3_bad_page_id_gives_nan_for_that_request_only(gather, pages_gathered):
    """A page id out of range in one request: every job of that request (they run among the other
    requests' jobs on the persistent CTAs) gives NaN, and no other job does; the same when the pages
    are gathered ahead (the bad page's copied rows are NaN)."""
    gathered = pages_gathered(gather)
    case = many_jobs_case(FA3[0], causal=False, seed=5)
    batch = build(case)
    victim = 6
    page_ids = batch.page_ids.clone()
    page_ids[int(batch.page_indptr[victim])] = batch.cache[0].shape[0] + 7
    out, lse = run_ours(case, Batch(**{**batch.__dict__, "page_ids": page_ids}))
    torch.cuda.synchronize()  # a fault would surface here, and poison every later test
    assert len(gathered) == gather
    others = rows_of_others(batch, victim)
    assert out[~others].isnan().all() and lse[~others].isnan().all(), "the bad request's rows must be NaN"
    o_ref, lse_ref = run_reference(case, batch)
    assert_matches_reference(case, out[others], lse[others], o_ref[others], lse_ref[others])


def poison_rows_outside_requests(case: Case, batch: Batch) -> None:
    """NaN into every cache row no request owns: its last page's tail, and unused pages."""
    pool = batch.cache[0].shape[0]
    used = torch.zeros(pool, case.page_size, dtype=torch.bool)
    ids = batch.page_ids.tolist()
    for request, kv_len in enumerate(case.kv_lens):
        first = int(batch.page_indptr[request])
        for j in range(int(batch.page_indptr[request + 1]) - first):
            used[ids[first + j], : min(case.page_size, kv_len - j * case.page_size)] = True
    for cache in batch.cache:
        rows = cache if case.layout == "NHD" else cache.transpose(1, 2)  # [pool, page_size, heads, dim]
        rows[~used.to(DEVICE)] = math.nan


@pytest.mark.parametrize(("page_size", "layout"), [(1, "NHD"), (5, "HND"), (16, "NHD")],
                         ids=["page1", "page5-hnd", "page16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("module", FA3, ids=["hd128", "hd64-fp16", "hd256", "window-cap", "hd192"])
def test_fa3_pages_gathered_ahead_match_reference(module, causal, page_size, layout, pages_gathered):
    """A paged plan whose keys are read by many q tiles copies its pages into ragged K and V first and
    runs the ragged kernel over the copies (forced here on short lengths). Every cache row outside
    the requests is NaN: the copy takes whole pages, and no output may see past its request's keys.
    The lengths give a request without queries, requests shorter than a tile and partial last pages;
    kv chunks of about 256 tokens split the longer requests."""
    gathered = pages_gathered(True)
    case = Case(module, qo_lens=[40, 3 if causal else 0, 300, 9, 130], kv_lens=[300, 177, 1000, 5, 700],
                causal=causal, paged=True, layout=layout, page_size=page_size, num_kv_heads=2, group=4,
                seed=page_size, window_left=200 if module.window else -1, soft_cap=30.0 if module.soft_cap else None)
    batch = build(case)
    poison_rows_outside_requests(case, batch)
    out, lse = run_ours(case, batch, fixed_split_size=-(-256 // page_size))
    assert len(gathered) == 1
    assert_matches_reference(case, out, lse, *run_reference(case, batch))


def test_fa3_gathered_pages_match_reference_on_drawn_batches(pages_gathered):
    """Drawn paged batches (page sizes 1 to 256, NHD and HND, ragged lengths up to 16k keys, requests
    without queries, GQA groups 1 to 8) with their pages gathered ahead (forced) and every cache row
    outside the requests NaN."""
    gathered = pages_gathered(True)

    @gpu_settings(max_examples=20)
    @given(cases(FA3))
    def check(case):
        case = dataclasses.replace(case, paged=True)
        note(repr(case))
        batch = build(case)
        poison_rows_outside_requests(case, batch)
        plans = len(gathered)
        out, lse = run_ours(case, batch)
        assert len(gathered) == plans + 1
        assert_matches_reference(case, out, lse, *run_reference(case, batch))

    check()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("module", [FA3[0], FA3[3]], ids=["hd128", "window-cap"])
def test_fa3_ragged_tiles_read_only_their_requests_keys(module, causal, split):
    """A ragged request's partial last kv tile starts a whole tile before its end (over keys the tile
    before it took, masked there) rather than reading past it: NaN keys and values in one request
    leave every other request's output exact, next to it on either side, whole or split into chunks.
    The lengths give last tiles of 1, most and all of a tile's keys, and requests shorter than one."""
    case = Case(module, qo_lens=[40, 33, 70, 9, 50, 64], kv_lens=[300, 177, 1000, 90, 700, 128], causal=causal,
                paged=False, layout="NHD", page_size=1, num_kv_heads=2, group=4, seed=9,
                window_left=200 if module.window else -1, soft_cap=30.0 if module.soft_cap else None)
    batch = build(case)
    o_ref, lse_ref = run_reference(case, batch)
    for victim in (2, 4):
        k, v = batch.k.clone(), batch.v.clone()
        kv_rows = slice(int(batch.kv_indptr[victim]), int(batch.kv_indptr[victim + 1]))
        k[kv_rows], v[kv_rows] = math.nan, math.inf
        poisoned = Batch(**{**batch.__dict__, "k": k, "v": v})
        out, lse = run_ours(case, poisoned, **({"fixed_split_size": 250} if split else {}))  # ragged: tokens
        others = rows_of_others(batch, victim)
        assert_matches_reference(case, out[others], lse[others], o_ref[others], lse_ref[others])


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


@gpu_settings(max_examples=10)
@given(cases([PLAIN[0]]))
def test_fa3_equals_fa2(case):
    """The two kernel families on one batch: same maths, different tiles and summation order."""
    note(repr(case))
    batch = build(case)
    fa2 = run_ours(case, batch)
    fa3 = run_ours(Case(**{**case.__dict__, "module": FA3[0]}), batch)
    torch.testing.assert_close(fa3[0].float(), fa2[0].float(), **O_TOL[case.module.dtype])
    seen = torch.isfinite(fa2[1])
    assert torch.equal(torch.isfinite(fa3[1]), seen)
    torch.testing.assert_close(fa3[1][seen], fa2[1][seen], **LSE_TOL)


def test_auto_picks_fa3_on_hopper_and_fa2_for_what_fa3_refuses():
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    indptr = torch.tensor([0, 4], dtype=torch.int32)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    plain = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    plain.plan(indptr, indptr, 8, 2, 128, q_data_type=torch.bfloat16)
    assert plain._plan.module.spec.backend.value == ("fa3" if hopper else "fa2")
    rope = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    rope.plan(indptr, indptr, 8, 2, 128, pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.bfloat16)
    assert rope._plan.module.spec.backend.value == "fa2"
    fp8_kv = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)  # FlashInfer #2148: bf16 q + fp8 KV is fa2's
    fp8_kv.plan(indptr, indptr, 8, 2, 128, q_data_type=torch.bfloat16, kv_data_type=E4M3)
    assert fp8_kv._plan.module.spec.backend.value == "fa2"
