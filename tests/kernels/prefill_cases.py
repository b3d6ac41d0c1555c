"""What the batch-prefill GPU tests share (test_prefill_gpu.py, test_prefill_fa3_gpu.py): tolerances,
the modules they may build, hypothesis-drawn cases (runtime arguments only), batches on the GPU, our
run into NaN-poisoned outputs, the reference run and the checks against it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

import attnforge
from attnforge import reference

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
