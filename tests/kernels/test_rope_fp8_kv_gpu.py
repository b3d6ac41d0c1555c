"""In-kernel RoPE (ROPE_LLAMA) over an fp8 KV cache in fa2 prefill and the tensor-core decode it serves.

FlashInfer's semantics (attnforge.reference): q rotated at its position (token + kv_len - qo_len, so a
decode query at kv_len - 1), key j at j; the reference dequantizes the cache (fp8 value * scale) and
then rotates, and a scalar k_scale commutes with the rotation. The kernel rotates each fp8 K tile
into an fp16 copy (prefill_loads.cuh rope_k_tile), so what is left against the fp32 reference is
the 16-bit rounding of the rotated q, K, P and o: the 16-bit RoPE tolerance. Three requests of odd
lengths, GQA 4, partial last pages, split KV (the merge runs), NaN-poisoned outputs and NaN in every
cache row no request owns.
Build the modules first: attnforge build --manifest tests/kernels/rope_fp8_kv_manifest.toml
"""

from __future__ import annotations

import pytest
import torch

import attnforge
from attnforge import reference
from launch_helpers import (DEVICE, E4M3, E5M2, REL_L2_TOL, SCALES, WORKSPACE, assert_close, dequantized, indptr_of,
                            paged_cache, poisoned, randn)

pytestmark = pytest.mark.gpu

QO_LENS, KV_LENS = [1, 37, 130], [45, 300, 161]
HEADS = (8, 2)  # GQA 4
KNOBS = {"default": {}, "scaled": dict(rope_scale=2.5, rope_theta=5e5)}
FP8 = [E4M3, E5M2]
FP8_IDS = ["e4m3", "e5m2"]


def _cache_ref(kv, scales: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(dequantized(x, scales.get(name, 1.0)) for x, name in zip(kv.cache, ("k_scale", "v_scale")))


def _paged_prefill(kv_dtype, head_dim: int, causal: bool, page_size: int, knobs: dict, seed: int,
                   reference_mode: str = "ROPE_LLAMA"):
    """(out, lse, reference o, reference lse) of one paged prefill of the three requests with RoPE, the
    reference computed with reference_mode."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = randn(gen, sum(QO_LENS), HEADS[0], head_dim).to(torch.bfloat16)
    k, v = (randn(gen, sum(KV_LENS), HEADS[1], head_dim) for _ in range(2))
    kv = paged_cache(k, v, KV_LENS, page_size, kv_dtype, gen)
    wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                            backend="fa2")
    wrapper.plan(indptr_of(QO_LENS), kv.indptr, kv.ids, kv.last, *HEADS, head_dim, page_size, causal=causal,
                 pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
                 fixed_split_size=64, **knobs)
    out, lse = poisoned(q.shape, torch.bfloat16)
    wrapper.run(q, kv.cache, out=out, lse=lse, return_lse=True, **SCALES)
    o_ref, lse_ref = reference.batch_prefill_paged(q.float(), _cache_ref(kv, SCALES), indptr_of(QO_LENS), kv.indptr,
                                                   kv.ids, kv.last, causal=causal, pos_encoding_mode=reference_mode,
                                                   **knobs)
    return out, lse, o_ref, lse_ref


@pytest.mark.parametrize("knobs", sorted(KNOBS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_paged_prefill_matches_reference(kv_dtype, head_dim, causal, knobs):
    out, lse, o_ref, lse_ref = _paged_prefill(kv_dtype, head_dim, causal, 16, KNOBS[knobs], seed=head_dim)
    assert_close(out, lse, o_ref, lse_ref, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_paged_prefill_page5_matches_reference(kv_dtype):
    """Pages of 5 tokens: a tile's rows come from many pages, the last ones partial."""
    out, lse, o_ref, lse_ref = _paged_prefill(kv_dtype, 128, True, 5, {}, seed=5)
    assert_close(out, lse, o_ref, lse_ref, torch.bfloat16)


def test_rope_changes_the_output():
    """Guards the tests above against a kernel that ignores RoPE over fp8 K: the reference without it
    is far from the kernel's output with it."""
    out, _, o_none, _ = _paged_prefill(E4M3, 128, True, 16, {}, seed=3, reference_mode="NONE")
    diff = (out.float() - o_none.float()).norm() / o_none.float().norm()
    assert diff > 10 * REL_L2_TOL[torch.bfloat16], f"RoPE moved o by only {diff:.3g}"


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_ragged_prefill_matches_reference(kv_dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    q = randn(gen, sum(QO_LENS), HEADS[0], 128).to(torch.bfloat16)
    k, v = (randn(gen, sum(KV_LENS), HEADS[1], 128).to(kv_dtype) for _ in range(2))
    wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                             backend="fa2")
    wrapper.plan(indptr_of(QO_LENS), indptr_of(KV_LENS), *HEADS, 128, causal=False, pos_encoding_mode="ROPE_LLAMA",
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype, fixed_split_size=64)
    out, lse = poisoned(q.shape, torch.bfloat16)
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True, **SCALES)
    o_ref, lse_ref = reference.batch_prefill_ragged(q.float(), dequantized(k, SCALES["k_scale"]),
                                                    dequantized(v, SCALES["v_scale"]), indptr_of(QO_LENS),
                                                    indptr_of(KV_LENS), causal=False, pos_encoding_mode="ROPE_LLAMA")
    assert_close(out, lse, o_ref, lse_ref, torch.bfloat16)


def test_e5m2_keys_near_the_format_max_stay_finite():
    """A rotated e5m2 pair reaches sqrt(2) x 57344 > fp16's 65504; the kernel's fp16 K tile holds it
    halved (kRotatedKScale). Keys of magnitude 2^15..2^16 with a tiny q keep the scores moderate."""
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    q = (randn(gen, sum(QO_LENS), HEADS[0], 128) * 2e-5).to(torch.bfloat16)
    k = torch.sign(randn(gen, sum(KV_LENS), HEADS[1], 128)) * 57344.0
    v = randn(gen, sum(KV_LENS), HEADS[1], 128)
    kv = paged_cache(k, v, KV_LENS, 16, E5M2, gen)
    wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                            backend="fa2")
    wrapper.plan(indptr_of(QO_LENS), kv.indptr, kv.ids, kv.last, *HEADS, 128, 16, causal=True,
                 pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.bfloat16, kv_data_type=E5M2)
    out, lse = poisoned(q.shape, torch.bfloat16)
    wrapper.run(q, kv.cache, out=out, lse=lse, return_lse=True)
    o_ref, lse_ref = reference.batch_prefill_paged(q.float(), _cache_ref(kv, {}), indptr_of(QO_LENS), kv.indptr,
                                                   kv.ids, kv.last, causal=True, pos_encoding_mode="ROPE_LLAMA")
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    assert_close(out, lse, o_ref, lse_ref, torch.bfloat16)


# ---------------------------------------------------------------------------------------
# tensor-core decode: the prefill kernel with one query row per request, the query at kv_len - 1


def _decode(tensor_cores: bool, kv_dtype, head_dim: int, page_size: int, knobs: dict, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    kv_lens = [45, 999, 161]  # the 999-key request splits into many chunks: partials and the merge
    k, v = (randn(gen, sum(kv_lens), HEADS[1], head_dim) for _ in range(2))
    kv = paged_cache(k, v, kv_lens, page_size, kv_dtype, gen)
    q = randn(gen, len(kv_lens), HEADS[0], head_dim).to(torch.bfloat16)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                           use_tensor_cores=tensor_cores)
    wrapper.plan(kv.indptr, kv.ids, kv.last, *HEADS, head_dim, page_size, pos_encoding_mode="ROPE_LLAMA",
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype, fixed_split_size=8, **knobs)
    out, lse = poisoned(q.shape, torch.bfloat16)
    wrapper.run(q, kv.cache, out=out, lse=lse, return_lse=True, **SCALES)
    o_ref, lse_ref = reference.batch_decode_paged(q.float(), _cache_ref(kv, SCALES), kv.indptr, kv.ids, kv.last,
                                                  pos_encoding_mode="ROPE_LLAMA", **knobs)
    return out, lse, o_ref, lse_ref


@pytest.mark.parametrize("knobs", sorted(KNOBS))
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_tensor_core_decode_matches_reference(kv_dtype, head_dim, page_size, knobs):
    out, lse, o_ref, lse_ref = _decode(True, kv_dtype, head_dim, page_size, KNOBS[knobs], seed=page_size + head_dim)
    assert_close(out, lse, o_ref, lse_ref, torch.bfloat16)


@pytest.mark.parametrize("page_size", [16, 5])
def test_tensor_cores_equal_cuda_cores(page_size):
    """Metamorphic: the CUDA-core decode kernel (fp32 rotation of each fp8 K cell) and the tensor-core
    path (the fp16 rotated K tile) place the query at kv_len - 1 alike, so they agree within bf16
    rounding."""
    out_cc, lse_cc, _, _ = _decode(False, E4M3, 128, page_size, {}, seed=7)
    out_tc, lse_tc, _, _ = _decode(True, E4M3, 128, page_size, {}, seed=7)
    assert not out_tc.isnan().any() and not out_cc.isnan().any()
    diff = (out_cc.float() - out_tc.float()).norm() / out_tc.float().norm()
    assert diff <= REL_L2_TOL[torch.bfloat16], f"CUDA cores vs tensor cores: relative L2 {diff:.3g}"
    torch.testing.assert_close(lse_cc, lse_tc, atol=2e-2, rtol=1e-3)
