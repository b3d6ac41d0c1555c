"""Every head dim between the natural tile widths (80, 96, 112, 160, 192, 224: rows that do not fill
whole 128-byte lines or power-of-two lane groups; 16-bit fa3 holds all but 192 in 32- or 64-byte
swizzle lines) in every kernel family, fa3 fp8 at 64, 96 and 192 (64- and 32-byte lines), qk > vo
pairs in prefill (fa2 (256, 128) and (256, 64); fa3 (256, 64) on its narrow kv tiles and (160, 96)
on 64-byte lines), and head dim 512 in fa2's (decode rows of two cells a lane; prefill o split
over two CTAs, each storing its half of the columns, one the lse), against attnforge.reference.

The modules are those of head_dims_manifest.toml beside this file (build them at once first:
`attnforge build --manifest tests/kernels/head_dims_manifest.toml`). Shapes reach the padding's edge
cases: three requests of odd lengths, partial last pages, GQA 4 (and 3, whose packed rows fa3
gathers instead of boxing), split KV so the merges run on real-width partial rows. Outputs are
NaN-poisoned first and cache rows no request owns hold NaN, so a padding column that reads past a
row, or one left unstored, shows up as NaN or as an error against the reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import attnforge
from attnforge import page, reference
from attnforge import prefill_plan_steps as plan_steps
from attnforge.codegen import manifest
from attnforge.codegen.kv_tiles import decode_tile
from attnforge.codegen.spec import Backend, Kind
from attnforge.planner import heads_per_cta

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
WORKSPACE = 128 << 20
QO_LENS, KV_LENS = [1, 37, 130], [45, 300, 161]
DECODE_KV_LENS = [45, 1000, 161]  # the 1000-key request splits (fixed_split_size), so the merge runs
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# relative L2 error of o against the fp32 reference, by the cache's dtype (bf16 / fp16 rounding; an
# fp8 cache's own rounding is in the reference's input, the query stays bf16)
REL_L2_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float8_e4m3fn: 1e-2}
SPECS = manifest.load(Path(__file__).with_name("head_dims_manifest.toml")).specs


def _specs(kind: Kind, backend: Backend, fp8_q: bool = False) -> list:
    """The plain modules of a family (plans without a mask, window or cap load those)."""
    return [s for s in SPECS if s.kind is kind and s.backend is backend and s.dtype_q.is_fp8 == fp8_q
            and not (s.use_custom_mask or s.use_sliding_window or s.use_logits_soft_cap)]


def _id(spec) -> str:
    vo = "" if spec.head_dim_vo == spec.head_dim_qk else f"x{spec.head_dim_vo}"
    return f"hd{spec.head_dim_qk}{vo}-q{spec.dtype_q.short}-kv{spec.dtype_kv.short}"


def randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, generator=gen)


def indptr_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def paged_cache(k, v, kv_lens, page_size, dtype, gen):
    """k [total_kv, heads, dim_qk], v [total_kv, heads, dim_vo] (fp32) in shuffled pages of NaN-filled
    pools, cast to dtype; a narrower V lives in pages of K's shape (the kernels share one row offset
    per page), passed as the view v_pages[..., :dim_vo]. Returns (cache, indptr, page ids, last page
    lengths)."""
    pages = [math.ceil(n / page_size) for n in kv_lens]
    pool = sum(pages) + 2
    ids = torch.randperm(pool, device=DEVICE, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = indptr_of(pages).to(DEVICE)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32, device=DEVICE)
    pools = [torch.full((pool, page_size, *k.shape[1:]), math.nan, device=DEVICE) for _ in range(2)]
    dim_vo = v.shape[-1]
    seq_lens = page.get_seq_lens(indptr, last, page_size)
    batch, positions = page.get_batch_indices_positions(indptr_of(kv_lens).to(DEVICE), seq_lens, k.shape[0])
    page.append_paged_kv_cache(k, v, batch, positions, (pools[0], pools[1][..., :dim_vo]), ids, indptr, last)
    return (pools[0].to(dtype), pools[1].to(dtype)[..., :dim_vo]), indptr, ids, last


def poisoned(rows: int, heads: int, dim: int, dtype: torch.dtype):
    return (torch.full((rows, heads, dim), math.nan, dtype=dtype, device=DEVICE),
            torch.full((rows, heads), math.nan, dtype=torch.float32, device=DEVICE))


def assert_close(out, lse, o_ref, lse_ref, dtype, what: str) -> None:
    nan_cols = out.isnan().any(dim=0).any(dim=0).nonzero().flatten().tolist()
    assert not nan_cols, f"{what}: o columns left unwritten or read NaN: {nan_cols[:16]}"
    assert not lse.isnan().any(), f"{what}: lse rows left unwritten"
    err = (out.float() - o_ref.float()).norm(dim=(0, 1)) / o_ref.float().norm(dim=(0, 1)).clamp_min(1e-6)
    diff = (out.float() - o_ref.float()).norm() / o_ref.float().norm()
    worst = err.argmax().item()
    assert diff <= REL_L2_TOL[dtype], (f"{what}: relative L2 error {diff:.3g} > {REL_L2_TOL[dtype]} "
                                       f"(worst column {worst}: {err[worst]:.3g})")
    torch.testing.assert_close(lse, lse_ref.float(), atol=2e-2, rtol=1e-3, msg=lambda m: f"{what}: lse: {m}")


def _decode(spec, tensor_cores: bool, backend: str, page_size: int, heads=(8, 2)):
    dim = spec.head_dim_qk
    q_dtype, kv_dtype = TORCH_DTYPE[spec.dtype_q.short], TORCH_DTYPE[spec.dtype_kv.short]
    gen = torch.Generator(device=DEVICE).manual_seed(dim)
    k, v = (randn(gen, sum(DECODE_KV_LENS), heads[1], dim) for _ in range(2))
    cache, indptr, ids, last = paged_cache(k, v, DECODE_KV_LENS, page_size, kv_dtype, gen)
    q = randn(gen, len(DECODE_KV_LENS), heads[0], dim).to(q_dtype)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                           use_tensor_cores=tensor_cores, backend=backend)
    wrapper.plan(indptr, ids, last, *heads, dim, page_size, q_data_type=q_dtype, kv_data_type=kv_dtype,
                 o_data_type=q_dtype, fixed_split_size=8)
    out, lse = poisoned(q.shape[0], heads[0], dim, q_dtype)
    wrapper.run(q, cache, out=out, lse=lse, return_lse=True)
    o_ref, lse_ref = reference.batch_prefill_paged(q.float(), tuple(x.float() for x in cache),
                                                   indptr_of([1] * len(DECODE_KV_LENS)), indptr, ids, last, causal=True)
    what = (f"{'tensor-core' if tensor_cores else 'cuda-core'} decode {backend} {_id(spec)} page {page_size} "
            f"group {heads[0] // heads[1]}")
    assert_close(out, lse, o_ref, lse_ref, kv_dtype, what)


@pytest.mark.parametrize("group", [8, 4, 2])
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("spec", _specs(Kind.DECODE, Backend.FA2), ids=_id)
def test_cuda_core_decode(spec, page_size, group):
    """The fa2 decode kernel: at groups 4 and 8, 16-bit padded dims run its tensor-core tile
    (kv_tiles.decode_tile): hd 80-112 on 128-column rows in 64-token tiles, hd 160-224 on 256-column
    rows in 32-token tiles of warp pairs; fp8 padded rows and hd 512 its CUDA-core tile; group 2
    runs the CUDA-core tile at every dim."""
    tile = decode_tile(spec, heads_per_cta(group)[0])
    assert tile.mma == (group >= 4 and spec.dtype_kv.bytes == 2 and spec.head_dim_qk < 256), tile
    _decode(spec, tensor_cores=False, backend="fa2", page_size=page_size, heads=(2 * group, 2))


@pytest.mark.parametrize("spec", [s for s in _specs(Kind.DECODE, Backend.FA2)
                                  if s.dtype_kv.bytes == 2 and s.head_dim_qk in (80, 96, 112)], ids=_id)
def test_cuda_core_decode_eight_kv_heads(spec):
    """Padded 16-bit rows of NHD pages with 8 kv heads side by side (page 16: whole 128-byte token
    rows): the head slices start at every 32-byte offset of a line, and the last one ends at the
    token row's end, where a read past the slice would take the next token's (or a NaN) row."""
    _decode(spec, tensor_cores=False, backend="fa2", page_size=16, heads=(32, 8))


@pytest.mark.parametrize("spec", [s for s in _specs(Kind.PREFILL, Backend.FA2) if s.head_dim_qk == s.head_dim_vo], ids=_id)
def test_tensor_core_decode_fa2(spec):
    _decode(spec, tensor_cores=True, backend="fa2", page_size=16)


def _prefill(spec, layout: str, causal: bool, page_size: int = 16, heads=(8, 2)):
    dim, dim_vo = spec.head_dim_qk, spec.head_dim_vo
    q_dtype, kv_dtype = TORCH_DTYPE[spec.dtype_q.short], TORCH_DTYPE[spec.dtype_kv.short]
    gen = torch.Generator(device=DEVICE).manual_seed(dim + dim_vo + causal)
    q = randn(gen, sum(QO_LENS), heads[0], dim).to(q_dtype)
    k, v = randn(gen, sum(KV_LENS), heads[1], dim), randn(gen, sum(KV_LENS), heads[1], dim_vo)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    options = dict(causal=causal, q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=q_dtype, fixed_split_size=64,
                   head_dim_vo=dim_vo)
    out, lse = poisoned(q.shape[0], heads[0], dim_vo, q_dtype)
    backend = spec.backend.value
    if layout == "ragged":
        k_in, v_in = k.to(kv_dtype), v.to(kv_dtype)
        wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend=backend)
        wrapper.plan(indptr_of(QO_LENS), indptr_of(KV_LENS), *heads, dim, **options)
        wrapper.run(q, k_in, v_in, out=out, lse=lse, return_lse=True)
        o_ref, lse_ref = reference.batch_prefill_ragged(q.float(), k_in.float(), v_in.float(), indptr_of(QO_LENS),
                                                        indptr_of(KV_LENS), causal=causal)
    else:
        cache, indptr, ids, last = paged_cache(k, v, KV_LENS, page_size, kv_dtype, gen)
        wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(workspace, backend=backend)
        wrapper.plan(indptr_of(QO_LENS), indptr, ids, last, *heads, dim, page_size, **options)
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True)
        o_ref, lse_ref = reference.batch_prefill_paged(q.float(), tuple(x.float() for x in cache), indptr_of(QO_LENS),
                                                       indptr, ids, last, causal=causal)
    what = f"{backend} prefill {layout} {_id(spec)} causal={causal} page {page_size} heads {heads}"
    assert_close(out, lse, o_ref, lse_ref, kv_dtype, what)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["paged", "ragged"])
@pytest.mark.parametrize("spec", _specs(Kind.PREFILL, Backend.FA2), ids=_id)
def test_fa2_prefill(spec, layout, causal):
    if layout == "ragged" and spec.dtype_kv.is_fp8:
        pytest.skip("ragged KV is 16-bit (fp8 caches are paged)")
    _prefill(spec, layout, causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["paged", "paged-page5", "ragged"])
@pytest.mark.parametrize("spec", _specs(Kind.PREFILL, Backend.FA3), ids=_id)
def test_fa3_prefill(spec, layout, causal):
    """Paged with 16-token pages (boxed by TMA, or gathered ahead), with 5-token pages (gathered by
    the producer's cp.async), ragged (TMA boxes): each fills the padding columns its own way."""
    _prefill(spec, layout.split("-")[0], causal, page_size=5 if layout.endswith("page5") else 16)


@pytest.mark.parametrize("spec", _specs(Kind.PREFILL, Backend.FA3), ids=_id)
def test_fa3_prefill_gqa3_gathers_q(spec):
    """GQA 3: a group that does not divide the tile, so fa3 gathers Q with cp.async (its padding
    cells zero-filled) instead of boxing it."""
    _prefill(spec, "paged", True, heads=(6, 2))


# fa3 fp8: q, k, v of one fp8 format, each randn divided by its scale and rounded (the tensor stands
# for fp8 value x scale), bf16 o, against the reference fed the dequantized values (fp32). What is
# left is P's e4m3 rounding (3 mantissa bits), the fp8 wgmma's accumulation and the bf16 output: the
# bounds of test_fa3_fp8_gpu.py (relative L2; max abs in units of max |v|).
FP8_SCALES = dict(q_scale=0.5, k_scale=2.0, v_scale=0.75)
FP8_REL_L2_TOL, FP8_MAX_ABS_TOL = 3e-2, 0.1
# The longest request spans several q tiles (9 of 192 rows, 13 of 128 at group 4), so the plan
# transposes V ahead unless told not to; ragged, the 161- and 300-key requests split into 64-key
# chunks (fixed_split_size 64 pages of one token), so partial rows of the padded tile are merged.
FP8_QO_LENS = [1, 37, 400]


def assert_close_fp8(out, lse, o_ref, lse_ref, v_max: float, what: str) -> None:
    nan_cols = out.isnan().any(dim=0).any(dim=0).nonzero().flatten().tolist()
    assert not nan_cols, f"{what}: o columns left unwritten or read NaN: {nan_cols[:16]}"
    assert not lse.isnan().any(), f"{what}: lse rows left unwritten"
    diff = out.float() - o_ref.float()
    rel_l2, max_abs = (diff.norm() / o_ref.float().norm()).item(), diff.abs().max().item()
    assert rel_l2 <= FP8_REL_L2_TOL, f"{what}: relative L2 error {rel_l2:.3g} > {FP8_REL_L2_TOL}"
    assert max_abs <= FP8_MAX_ABS_TOL * v_max, f"{what}: max abs error {max_abs:.3g} > {FP8_MAX_ABS_TOL} x {v_max:.3g}"
    torch.testing.assert_close(lse, lse_ref.float(), atol=2e-2, rtol=1e-3, msg=lambda m: f"{what}: lse: {m}")


def transposes_v_ahead(monkeypatch, ahead: bool) -> list:
    """Whether plan() may transpose V ahead (its own decision) or not (forced off); returns the list
    of its decisions (None: the kernel transposes)."""
    planned = []
    real = plan_steps.transposed_v_blocks
    monkeypatch.setattr(plan_steps, "transposed_v_blocks",
                        lambda *args: planned.append(real(*args) if ahead else None) or planned[-1])
    return planned


@pytest.mark.parametrize("v_ahead", [False, True], ids=["kernel_transposes", "v_transposed_ahead"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["paged", "paged-page5", "ragged"])
@pytest.mark.parametrize("spec", _specs(Kind.PREFILL, Backend.FA3, fp8_q=True), ids=_id)
def test_fa3_fp8_prefill(spec, layout, causal, v_ahead, monkeypatch):
    """fa3 fp8 on a padded tile dim: paged with 16-token pages (K and V rows boxed by TMA, V
    transposed from its staging buffers), with 5-token pages (gathered by cp.async, V transposed on
    the way), ragged (TMA boxes); V transposed by the kernel or ahead of it (one box of the real
    dims per tile). GQA 4, NaN outputs and NaN cache rows no request owns."""
    dim, fp8 = spec.head_dim_qk, TORCH_DTYPE[spec.dtype_q.short]
    page_size = 5 if layout.endswith("page5") else 16
    gen = torch.Generator(device=DEVICE).manual_seed(dim + causal)
    heads = (8, 2)
    q = (randn(gen, sum(FP8_QO_LENS), heads[0], dim) / FP8_SCALES["q_scale"]).to(fp8)
    k, v = (randn(gen, sum(KV_LENS), heads[1], dim) / FP8_SCALES[name] for name in ("k_scale", "v_scale"))
    planned = transposes_v_ahead(monkeypatch, v_ahead)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    options = dict(causal=causal, q_data_type=fp8, kv_data_type=fp8, o_data_type=torch.bfloat16, fixed_split_size=64)
    out, lse = poisoned(q.shape[0], heads[0], dim, torch.bfloat16)
    q_ref = q.float() * FP8_SCALES["q_scale"]
    if layout == "ragged":
        k_in, v_in = k.to(fp8), v.to(fp8)
        wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend="fa3")
        wrapper.plan(indptr_of(FP8_QO_LENS), indptr_of(KV_LENS), *heads, dim, **options)
        wrapper.run(q, k_in, v_in, out=out, lse=lse, return_lse=True, **FP8_SCALES)
        o_ref, lse_ref = reference.batch_prefill_ragged(
            q_ref, k_in.float() * FP8_SCALES["k_scale"], v_in.float() * FP8_SCALES["v_scale"], indptr_of(FP8_QO_LENS),
            indptr_of(KV_LENS), causal=causal, o_dtype=torch.float32)
        v_max = (v_in.float() * FP8_SCALES["v_scale"]).abs().max().item()
    else:
        cache, indptr, ids, last = paged_cache(k, v, KV_LENS, page_size, fp8, gen)
        wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(workspace, backend="fa3")
        wrapper.plan(indptr_of(FP8_QO_LENS), indptr, ids, last, *heads, dim, page_size, **options)
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **FP8_SCALES)
        dequantized = (cache[0].float() * FP8_SCALES["k_scale"], cache[1].float() * FP8_SCALES["v_scale"])
        o_ref, lse_ref = reference.batch_prefill_paged(q_ref, dequantized, indptr_of(FP8_QO_LENS), indptr, ids, last,
                                                       causal=causal, o_dtype=torch.float32)
        v_max = v.to(fp8).float().abs().max().item() * FP8_SCALES["v_scale"]
    assert len(planned) == 1 and (planned[0] is not None) == v_ahead, "the plan transposes V ahead when let"
    what = f"fa3 fp8 prefill {layout} {_id(spec)} causal={causal} v_ahead={v_ahead}"
    assert_close_fp8(out, lse, o_ref, lse_ref, v_max, what)


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("group", [4, 16])
@pytest.mark.parametrize("spec", _specs(Kind.PREFILL, Backend.FA3, fp8_q=True), ids=_id)
def test_fa3_fp8_tensor_core_decode(spec, group, page_size):
    """Tensor-core decode on fa3 fp8 (the decode instantiations: group 4 with the keys along M at
    tile dim 128, in warp 0 of the 64-row tiles at 256; group 16 in the 64-row tiles), split into
    8-page chunks so the 1000-key request's partial rows are merged."""
    dim, fp8 = spec.head_dim_qk, TORCH_DTYPE[spec.dtype_q.short]
    gen = torch.Generator(device=DEVICE).manual_seed(dim + group)
    heads = (2 * group, 2)
    k, v = (randn(gen, sum(DECODE_KV_LENS), heads[1], dim) / FP8_SCALES[name] for name in ("k_scale", "v_scale"))
    cache, indptr, ids, last = paged_cache(k, v, DECODE_KV_LENS, page_size, fp8, gen)
    q = (randn(gen, len(DECODE_KV_LENS), heads[0], dim) / FP8_SCALES["q_scale"]).to(fp8)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                           use_tensor_cores=True, backend="fa3")
    wrapper.plan(indptr, ids, last, *heads, dim, page_size, q_data_type=fp8, kv_data_type=fp8,
                 o_data_type=torch.bfloat16, fixed_split_size=8)
    out, lse = poisoned(q.shape[0], heads[0], dim, torch.bfloat16)
    wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **FP8_SCALES)
    dequantized = (cache[0].float() * FP8_SCALES["k_scale"], cache[1].float() * FP8_SCALES["v_scale"])
    o_ref, lse_ref = reference.batch_prefill_paged(q.float() * FP8_SCALES["q_scale"], dequantized,
                                                   indptr_of([1] * len(DECODE_KV_LENS)), indptr, ids, last,
                                                   causal=True, o_dtype=torch.float32)
    v_max = v.to(fp8).float().abs().max().item() * FP8_SCALES["v_scale"]
    assert_close_fp8(out, lse, o_ref, lse_ref, v_max, f"fa3 fp8 tensor-core decode {_id(spec)} group {group} page {page_size}")


WIDE = [s for s in SPECS if s.head_dim_qk == 512 and s.use_custom_mask]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("layout", ["paged", "ragged"])
@pytest.mark.parametrize("spec", WIDE, ids=_id)
def test_fa2_512_mask_window_cap_sinks(spec, layout, split):
    """Head dim 512 with every compiled-in variant at once (custom mask, sliding window, soft cap) and
    attention sinks, split over kv chunks or not: both o slices must mask, cap and join the sink alike,
    and the merge must see whole 512-column partial rows."""
    dim, heads = 512, (8, 2)
    q_dtype = TORCH_DTYPE[spec.dtype_q.short]
    gen = torch.Generator(device=DEVICE).manual_seed(512 + split)
    q = randn(gen, sum(QO_LENS), heads[0], dim).to(q_dtype)
    k, v = randn(gen, sum(KV_LENS), heads[1], dim), randn(gen, sum(KV_LENS), heads[1], dim)
    mask = torch.rand(sum(a * b for a, b in zip(QO_LENS, KV_LENS)), device=DEVICE, generator=gen) < 0.7
    sinks = randn(gen, heads[0])
    options = dict(custom_mask=mask, window_left=90, logits_soft_cap=30.0, q_data_type=q_dtype, kv_data_type=q_dtype,
                   o_data_type=q_dtype, **(dict(fixed_split_size=64) if split else dict(disable_split_kv=True)))
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    out, lse = poisoned(q.shape[0], heads[0], dim, q_dtype)
    k_in, v_in = k.to(q_dtype), v.to(q_dtype)
    if layout == "ragged":
        wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend="fa2")
        wrapper.plan(indptr_of(QO_LENS), indptr_of(KV_LENS), *heads, dim, **options)
        wrapper.run(q, k_in, v_in, out=out, lse=lse, return_lse=True, sinks=sinks)
    else:
        cache, indptr, ids, last = paged_cache(k, v, KV_LENS, 16, q_dtype, gen)
        wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(workspace, backend="fa2")
        wrapper.plan(indptr_of(QO_LENS), indptr, ids, last, *heads, dim, 16, **options)
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True, sinks=sinks)
    bits = indptr_of([a * b for a, b in zip(QO_LENS, KV_LENS)])
    packed, mask_indptr = attnforge.segment_packbits(mask, bits.to(DEVICE), bitorder="little")
    o_ref, lse_ref = reference.batch_prefill_ragged(q.float(), k_in.float(), v_in.float(), indptr_of(QO_LENS),
                                                    indptr_of(KV_LENS), window_left=90, logits_soft_cap=30.0,
                                                    packed_custom_mask=packed, mask_indptr=mask_indptr, sinks=sinks)
    what = f"fa2 prefill {layout} {_id(spec)} mask+window+cap+sinks split={split}"
    assert_close(out, lse, o_ref, lse_ref, q_dtype, what)
