"""One small launch of every kernel family and variant class, checked against attnforge.reference.

These are the launches `.ci/gpu-session sanitize` runs under compute-sanitizer (memcheck, racecheck,
synccheck, initcheck): small enough for the tools' slowdown, shaped to reach the edge cases a race
or a stray access hides in (three requests of odd lengths, partial last pages, GQA 4, split KV so
the merge runs). Each launch also stands as a GPU test: outputs are NaN-poisoned first, unused cache
rows hold NaN, and the result must match the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import attnforge
from attnforge import quantization, reference
from launch_helpers import (DEVICE, E4M3, E5M2, SCALES, WORKSPACE, assert_close, dequantized, indptr_of,
                            paged_cache, poisoned, randn)

pytestmark = pytest.mark.gpu

QO_LENS, KV_LENS = [1, 37, 130], [45, 300, 161]  # causal: every request has at least its queries' keys
HEADS = (8, 2)  # GQA 4


# ---------------------------------------------------------------------------------------
# decode


@dataclass(frozen=True)
class DecodeLaunch:
    tensor_cores: bool
    backend: str = "fa2"
    q_dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    head_dim: int = 128
    page_size: int = 16
    group: int = 4
    q_len: int = 1  # tokens per request (multi-token decode)
    sinks: bool = False  # attention sinks: joined in the epilogue, and in the merge for the split request
    pos_encoding_mode: str = "NONE"  # RoPE / ALiBi in the kernel (the query at position kv_len - 1)


DECODES = {
    "cuda-cores": DecodeLaunch(False),
    "cuda-cores-fp8-kv": DecodeLaunch(False, kv_dtype=E4M3),
    "cuda-cores-hd64-page5": DecodeLaunch(False, head_dim=64, page_size=5),
    "cuda-cores-hd96-mma-tile-page5": DecodeLaunch(False, head_dim=96, page_size=5),  # padded rows, tensor cores
    "cuda-cores-hd192-warp-pairs": DecodeLaunch(False, head_dim=192),  # 32-token tile, warp pairs per 16 rows
    "tensor-cores-fa2": DecodeLaunch(True),
    "tensor-cores-fa2-hd64": DecodeLaunch(True, head_dim=64),  # the 16-row tile's widest kv tile
    "tensor-cores-fa2-fp8-kv": DecodeLaunch(True, kv_dtype=E5M2, q_dtype=torch.float16),
    "tensor-cores-fa3-keys-along-m": DecodeLaunch(True, "fa3"),
    "tensor-cores-fa3-rows-64": DecodeLaunch(True, "fa3", group=16),
    "tensor-cores-fa3-fp8": DecodeLaunch(True, "fa3", q_dtype=E4M3, kv_dtype=E4M3),
    "tensor-cores-fa3-fp8-page5": DecodeLaunch(True, "fa3", q_dtype=E4M3, kv_dtype=E4M3, page_size=5),
    # fp8 on narrow lines: hd 96's keys along M on a V^T of 128 rows (32 never written), hd 64's 64-row items
    "tensor-cores-fa3-fp8-hd96": DecodeLaunch(True, "fa3", q_dtype=E4M3, kv_dtype=E4M3, head_dim=96),
    "tensor-cores-fa3-fp8-hd64-rows-64": DecodeLaunch(True, "fa3", q_dtype=E4M3, kv_dtype=E4M3, head_dim=64, group=16),
    "multi-token-fa2": DecodeLaunch(True, q_len=3),
    "multi-token-fa3": DecodeLaunch(True, "fa3", q_len=3),
    "cuda-cores-sinks": DecodeLaunch(False, sinks=True),
    "cuda-cores-rope-page5": DecodeLaunch(False, page_size=5, pos_encoding_mode="ROPE_LLAMA"),
    "tensor-cores-fa2-rope-fp8-kv-page5": DecodeLaunch(True, kv_dtype=E5M2, page_size=5,
                                                       pos_encoding_mode="ROPE_LLAMA"),
}


@pytest.mark.parametrize("name", sorted(DECODES))
def test_decode_launch(name):
    d = DECODES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(len(name))
    kv_heads = 2 if d.group <= 4 else 1
    qo_heads = kv_heads * d.group
    kv_lens = [45, 1000, 161]  # the 1000-key request splits (fixed_split_size), so the merge runs
    fp8_kv = d.kv_dtype in (E4M3, E5M2)
    k, v = (randn(gen, sum(kv_lens), kv_heads, d.head_dim) for _ in range(2))
    kv = paged_cache(k, v, kv_lens, d.page_size, d.kv_dtype, gen)
    q = randn(gen, len(kv_lens) * d.q_len, qo_heads, d.head_dim).to(d.q_dtype)
    o_dtype = torch.bfloat16 if d.q_dtype == E4M3 else d.q_dtype
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                           use_tensor_cores=d.tensor_cores, backend=d.backend)
    wrapper.plan(kv.indptr, kv.ids, kv.last, qo_heads, kv_heads, d.head_dim, d.page_size, q_data_type=d.q_dtype,
                 kv_data_type=d.kv_dtype, o_data_type=o_dtype, fixed_split_size=8, q_len_per_req=d.q_len,
                 pos_encoding_mode=d.pos_encoding_mode)
    out, lse = poisoned(q.shape, o_dtype)
    scales = SCALES if fp8_kv else {}
    sinks = randn(gen, qo_heads) if d.sinks else None
    wrapper.run(q, kv.cache, out=out, lse=lse, return_lse=True, sinks=sinks, **scales)
    # the reference: causal prefill of each request's q_len tokens over its dequantized pages
    cache = tuple(dequantized(x, scales.get(name, 1.0)) for x, name in zip(kv.cache, ("k_scale", "v_scale")))
    o_ref, lse_ref = reference.batch_prefill_paged(q.float(), cache, indptr_of([d.q_len] * len(kv_lens)), kv.indptr,
                                                   kv.ids, kv.last, causal=True, sinks=sinks,
                                                   pos_encoding_mode=d.pos_encoding_mode)
    assert_close(out, lse, o_ref, lse_ref, d.kv_dtype if fp8_kv else d.q_dtype)


# ---------------------------------------------------------------------------------------
# prefill


@dataclass(frozen=True)
class PrefillLaunch:
    backend: str
    page_size: int | None  # None: ragged
    dtype: torch.dtype = torch.bfloat16  # q (and, for fa3 fp8, k and v)
    kv_dtype: torch.dtype | None = None  # None: dtype
    head_dims: tuple[int, int] = (128, 128)
    causal: bool = True
    mask: bool = False
    pos_encoding_mode: str = "NONE"
    sinks: bool = False  # attention sinks (split rows: joined in the merge)


PREFILLS = {
    "fa2-paged": PrefillLaunch("fa2", 16),
    "fa2-ragged": PrefillLaunch("fa2", None, causal=False),
    "fa2-paged-page5-hd64": PrefillLaunch("fa2", 5, head_dims=(64, 64)),
    "fa2-custom-mask": PrefillLaunch("fa2", None, causal=False, mask=True),
    "fa2-rope": PrefillLaunch("fa2", 16, pos_encoding_mode="ROPE_LLAMA"),
    "fa2-alibi": PrefillLaunch("fa2", 16, pos_encoding_mode="ALIBI"),
    "fa2-fp8-kv": PrefillLaunch("fa2", 16, kv_dtype=E4M3),
    "fa2-rope-fp8-kv": PrefillLaunch("fa2", 16, kv_dtype=E4M3, pos_encoding_mode="ROPE_LLAMA"),
    "fa3-paged": PrefillLaunch("fa3", 16),
    "fa3-paged-gathered-page5": PrefillLaunch("fa3", 5),
    "fa3-ragged": PrefillLaunch("fa3", None, causal=False),
    "fa3-hd192-128": PrefillLaunch("fa3", 16, head_dims=(192, 128)),
    "fa3-ragged-hd192": PrefillLaunch("fa3", None, causal=False, head_dims=(192, 192)),
    # Narrow swizzle lines: 32-byte Q/K lines and 64-byte V lines boxed (ragged), 32-byte ones of 10
    # cells a row gathered cell by cell (page 5) and o's last 8-column blocks stored two columns a lane.
    "fa3-ragged-hd112-96": PrefillLaunch("fa3", None, causal=False, head_dims=(112, 96)),
    "fa3-paged-gathered-page5-hd80": PrefillLaunch("fa3", 5, head_dims=(80, 80)),
    "fa2-paged-hd192": PrefillLaunch("fa2", 16, head_dims=(192, 192)),
    "fa3-fp8-paged": PrefillLaunch("fa3", 16, dtype=E4M3),
    "fa3-fp8-ragged": PrefillLaunch("fa3", None, dtype=E4M3),
    "fa3-fp8-paged-page5": PrefillLaunch("fa3", 5, dtype=E5M2),
    # fp8 on narrow lines: 32-byte Q/K lines with V transposed ahead (ragged), 64-byte ones with V rows
    # staged in 256-column lines and transposed into a V^T of 192 rows (paged)
    "fa3-fp8-ragged-hd96": PrefillLaunch("fa3", None, dtype=E4M3, head_dims=(96, 96)),
    "fa3-fp8-paged-hd192": PrefillLaunch("fa3", 16, dtype=E5M2, head_dims=(192, 192)),
    "fa2-paged-sinks": PrefillLaunch("fa2", 16, sinks=True),
    "fa3-ragged-sinks": PrefillLaunch("fa3", None, sinks=True),
}


@pytest.mark.parametrize("name", sorted(PREFILLS))
def test_prefill_launch(name):
    p = PREFILLS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(len(name))
    dim_qk, dim_vo = p.head_dims
    kv_dtype = p.kv_dtype or p.dtype
    fp8 = kv_dtype in (E4M3, E5M2)
    o_dtype = torch.bfloat16 if p.dtype in (E4M3, E5M2) else p.dtype
    scales = SCALES if fp8 else {}
    if p.dtype in (E4M3, E5M2):
        scales = dict(SCALES, q_scale=0.75)
    q = randn(gen, sum(QO_LENS), HEADS[0], dim_qk)
    k, v = randn(gen, sum(KV_LENS), HEADS[1], dim_qk), randn(gen, sum(KV_LENS), HEADS[1], dim_vo)
    mask = packed = None
    if p.mask:
        cells = [a * b for a, b in zip(QO_LENS, KV_LENS)]
        mask = torch.rand(sum(cells), device=DEVICE, generator=gen) < 0.6
        packed, _ = quantization.segment_packbits(mask, indptr_of(cells).to(DEVICE), bitorder="little")
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    options = dict(head_dim_vo=dim_vo, custom_mask=mask, causal=p.causal, pos_encoding_mode=p.pos_encoding_mode,
                   q_data_type=p.dtype, kv_data_type=kv_dtype, o_data_type=o_dtype, fixed_split_size=64)
    q_in = q.to(p.dtype)
    out, lse = poisoned((q.shape[0], HEADS[0], dim_vo), o_dtype)
    sinks = randn(gen, HEADS[0]) if p.sinks else None
    if p.page_size is None:
        k_in, v_in = k.to(kv_dtype), v.to(kv_dtype)
        wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend=p.backend)
        wrapper.plan(indptr_of(QO_LENS), indptr_of(KV_LENS), *HEADS, dim_qk, **options)
        wrapper.run(q_in, k_in, v_in, out=out, lse=lse, return_lse=True, sinks=sinks, **scales)
        o_ref, lse_ref = reference.batch_prefill_ragged(
            dequantized(q_in, scales.get("q_scale", 1.0)), dequantized(k_in, scales.get("k_scale", 1.0)),
            dequantized(v_in, scales.get("v_scale", 1.0)), indptr_of(QO_LENS), indptr_of(KV_LENS),
            causal=p.causal, packed_custom_mask=packed, pos_encoding_mode=p.pos_encoding_mode, sinks=sinks)
    else:
        kv = paged_cache(k, v, KV_LENS, p.page_size, kv_dtype, gen)
        wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(workspace, backend=p.backend)
        wrapper.plan(indptr_of(QO_LENS), kv.indptr, kv.ids, kv.last, *HEADS, dim_qk, p.page_size, **options)
        wrapper.run(q_in, kv.cache, out=out, lse=lse, return_lse=True, sinks=sinks, **scales)
        cache = tuple(dequantized(x, scales.get(s, 1.0)) for x, s in zip(kv.cache, ("k_scale", "v_scale")))
        o_ref, lse_ref = reference.batch_prefill_paged(
            dequantized(q_in, scales.get("q_scale", 1.0)), cache, indptr_of(QO_LENS), kv.indptr, kv.ids, kv.last,
            causal=p.causal, packed_custom_mask=packed, pos_encoding_mode=p.pos_encoding_mode, sinks=sinks)
    assert_close(out, lse, o_ref, lse_ref, kv_dtype if fp8 else p.dtype)
