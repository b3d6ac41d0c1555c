"""CUDA-core decode with in-kernel RoPE (ROPE_LLAMA) and ALiBi, FlashInfer's pos_encoding_mode.

The query sits at position kv_len - 1 of its request and key j at j. Three requests of odd lengths,
GQA 4, pages of 16 and 5 tokens, split KV (fixed_split_size) so the merge runs, outputs NaN-poisoned
and unused cache rows NaN (test_small_launches_gpu's helpers), against attnforge.reference. The
metamorphic check: the CUDA-core kernel equals the tensor-core path (fa2 prefill, which has RoPE).
Build the modules first: attnforge build --manifest tests/kernels/pos_encoding_manifest.toml
"""

from __future__ import annotations

import pytest
import torch

import attnforge
from attnforge import reference
from launch_helpers import (DEVICE, E4M3, REL_L2_TOL, SCALES, WORKSPACE, assert_close, dequantized, paged_cache,
                            poisoned, randn)

pytestmark = pytest.mark.gpu

KV_LENS = [45, 999, 161]  # the 999-key request splits into many chunks: partials and the merge
HEADS = (8, 2)  # GQA 4
HEAD_DIM = 128
MODES = {
    "rope-default": ("ROPE_LLAMA", {}),
    "rope-scaled": ("ROPE_LLAMA", dict(rope_scale=2.5, rope_theta=5e5)),
    "alibi": ("ALIBI", {}),
}


def _decode(tensor_cores: bool, mode: str, knobs: dict, kv_dtype, page_size: int, seed: int):
    """(out, lse, reference o, reference lse) of one decode step of the three requests."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    k, v = (randn(gen, sum(KV_LENS), HEADS[1], HEAD_DIM) for _ in range(2))
    kv = paged_cache(k, v, KV_LENS, page_size, kv_dtype, gen)
    q = randn(gen, len(KV_LENS), HEADS[0], HEAD_DIM).to(torch.bfloat16)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                           use_tensor_cores=tensor_cores)
    wrapper.plan(kv.indptr, kv.ids, kv.last, *HEADS, HEAD_DIM, page_size, pos_encoding_mode=mode,
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype, fixed_split_size=8, **knobs)
    out, lse = poisoned(q.shape, torch.bfloat16)
    scales = SCALES if kv_dtype == E4M3 else {}
    wrapper.run(q, kv.cache, out=out, lse=lse, return_lse=True, **scales)
    cache = tuple(dequantized(x, scales.get(name, 1.0)) for x, name in zip(kv.cache, ("k_scale", "v_scale")))
    o_ref, lse_ref = reference.batch_decode_paged(q.float(), cache, kv.indptr, kv.ids, kv.last,
                                                  pos_encoding_mode=mode, **knobs)
    return out, lse, o_ref, lse_ref


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("case", sorted(MODES))
def test_cuda_core_decode_matches_reference(case, kv_dtype, page_size):
    mode, knobs = MODES[case]
    out, lse, o_ref, lse_ref = _decode(False, mode, knobs, kv_dtype, page_size, seed=page_size)
    assert_close(out, lse, o_ref, lse_ref, kv_dtype)


def test_pos_encoding_changes_the_output():
    """Guards the test above against a kernel that ignores pos_encoding_mode: the reference without
    it is far from the kernel's output with it."""
    out, _, _, _ = _decode(False, "ROPE_LLAMA", {}, torch.bfloat16, 16, seed=3)
    _, _, o_none, _ = _decode(False, "NONE", {}, torch.bfloat16, 16, seed=3)
    diff = (out.float() - o_none).norm() / o_none.norm()
    assert diff > 10 * REL_L2_TOL[torch.bfloat16], f"RoPE moved o by only {diff:.3g}"


@pytest.mark.parametrize("case", ["rope-default", "rope-scaled"])
@pytest.mark.parametrize("page_size", [16, 5])
def test_cuda_cores_equal_tensor_cores(case, page_size):
    """Metamorphic: the CUDA-core kernel and the tensor-core path (fa2 prefill, one query row per
    request) rotate the same q and keys, so their outputs agree within bf16 rounding."""
    mode, knobs = MODES[case]
    out_cc, lse_cc, _, _ = _decode(False, mode, knobs, torch.bfloat16, page_size, seed=7)
    out_tc, lse_tc, _, _ = _decode(True, mode, knobs, torch.bfloat16, page_size, seed=7)
    assert not out_tc.isnan().any()
    diff = (out_cc.float() - out_tc.float()).norm() / out_tc.float().norm()
    assert diff <= REL_L2_TOL[torch.bfloat16], f"CUDA cores vs tensor cores: relative L2 {diff:.3g}"
    torch.testing.assert_close(lse_cc, lse_tc, atol=2e-2, rtol=1e-3)
