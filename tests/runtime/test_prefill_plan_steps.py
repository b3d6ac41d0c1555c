"""The batch-prefill plan() steps that run without a device (CPU): what check_request and
check_options derive and refuse, and where carve_workspace places the split-KV partials and fa3's
work done ahead in the float workspace."""

from __future__ import annotations

import math

import pytest
import torch

from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import PosEncoding
from attnforge.prefill_ahead import VT_BLOCK_KEYS, gathered_kv_bytes
from attnforge.prefill_plan_steps import PlanRequest, Schedule, carve_workspace, check_options, check_request

QO_LENS, KV_LENS, PAGE = (5, 1, 40), (37, 16, 100), 16


def _indptr(lens, start: int = 0) -> torch.Tensor:
    out = [start]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def paged(**overrides) -> PlanRequest:
    pages = [-(-n // PAGE) for n in KV_LENS]
    args = dict(paged=True, qo_indptr=_indptr(QO_LENS), kv_indptr=_indptr(pages), indices=torch.arange(sum(pages),
                dtype=torch.int32), last_page_len=torch.tensor([n - (p - 1) * PAGE for n, p in zip(KV_LENS, pages)],
                dtype=torch.int32), num_qo_heads=8, num_kv_heads=2, head_dim_qk=128, head_dim_vo=None, page_size=PAGE)
    args.update(overrides)
    return check_request(**args)


def options(**overrides):
    args = dict(head_dim_qk=128, custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
                rope_theta=None, q_data_type=torch.bfloat16, kv_data_type=None, o_data_type=None,
                fixed_split_size=None, disable_split_kv=False)
    args.update(overrides)
    return check_options(**args)


def test_request_derives_batch_totals_and_group():
    r = paged()
    assert (r.batch_size, r.total_q, r.total_kv, r.group, r.head_dim_vo) == (3, 46, 11, 4, 128)
    ragged = check_request(paged=False, qo_indptr=_indptr(QO_LENS), kv_indptr=_indptr(KV_LENS), indices=None,
                           last_page_len=None, num_qo_heads=4, num_kv_heads=4, head_dim_qk=192, head_dim_vo=128,
                           page_size=1)
    assert (ragged.paged, ragged.total_kv, ragged.group, ragged.head_dim_vo) == (False, sum(KV_LENS), 1, 128)


@pytest.mark.parametrize("overrides, text", [
    (dict(qo_indptr=torch.tensor([0], dtype=torch.int32)), "qo_indptr: expected at least 2 entries"),
    (dict(kv_indptr=torch.tensor([0, 3], dtype=torch.int32)), "paged_kv_indptr: expected 4 entries, got 2"),
    (dict(paged=False, kv_indptr=torch.tensor([0, 3], dtype=torch.int32)), "kv_indptr: expected 4 entries, got 2"),
    (dict(indices=torch.arange(11)), "paged_kv_indices"),
    (dict(num_qo_heads=6, num_kv_heads=4), "num_qo_heads=6 must be a multiple of num_kv_heads=4"),
    (dict(head_dim_vo=0), r"head_dim_vo: expected an int in \[1, 2147483647\] \(int32 field of the kernel\), got 0"),
    (dict(page_size=0), r"page_size: expected an int in \[1, 2147483647\] \(int32 field of the kernel\), got 0"),
    (dict(last_page_len=torch.ones(2, dtype=torch.int32)), "paged_kv_last_page_len: expected 3 entries, got 2"),
])
def test_request_errors_name_the_argument(overrides, text):
    with pytest.raises(ValueError, match=text):
        paged(**overrides)


def test_options_defaults():
    o = options(head_dim_qk=64, q_data_type=torch.float8_e4m3fn)
    assert (o.dtype_q, o.dtype_kv, o.dtype_o) == (DType.E4M3, DType.E4M3, DType.BF16)
    assert o.sm_scale == 1.0 / math.sqrt(64) and (o.rope_scale, o.rope_theta, o.soft_cap) == (1.0, 1e4, 0.0)
    assert o.pos_encoding is PosEncoding.NONE and not o.use_custom_mask and o.causal is False
    assert options(packed_custom_mask=torch.zeros(1, dtype=torch.uint8)).use_custom_mask


def test_a_custom_mask_wins_over_causal():
    """FlashInfer: causal applies only without a custom mask, so causal=True with one is accepted
    and the plan (its kv ranges, the kernel's mask mode) is the mask's alone."""
    assert options(causal=True).causal is True
    for mask in (dict(custom_mask=torch.ones(4, dtype=torch.bool)), dict(packed_custom_mask=torch.ones(1, dtype=torch.uint8))):
        with_causal, without = options(causal=True, **mask), options(causal=False, **mask)
        assert with_causal.use_custom_mask and with_causal.causal is False
        assert with_causal.causal == without.causal


@pytest.mark.parametrize("overrides, text", [
    (dict(custom_mask=torch.ones(1, dtype=torch.bool), packed_custom_mask=torch.ones(1, dtype=torch.uint8)),
     "custom_mask, packed_custom_mask: pass one of them, not both"),
    (dict(use_fp16_qk_reduction=True), "use_fp16_qk_reduction: the prefill kernels accumulate q.k in fp32"),
    (dict(window_left=-2), r"window_left: expected an int in \[-1, 2147483647\] \(-1: no window"),
    (dict(sm_scale=0.0), "sm_scale: expected a positive float or None, got 0.0"),
    (dict(fixed_split_size=0), r"fixed_split_size: expected an int in \[1, 2147483647\]"),
    (dict(pos_encoding_mode="ROPE"), "pos_encoding_mode: expected one of"),
])
def test_options_errors_name_the_argument(overrides, text):
    with pytest.raises(ValueError, match=text):
        options(**overrides)


def schedule_of(request: PlanRequest, *, num_partials: int = 0, tile: int = 128, may_gather: bool = False,
                may_transpose_v: bool = False) -> Schedule:
    """A schedule as the planner leaves it for carve_workspace: only kv_len in the image matters."""
    batch = request.batch_size
    offsets = {"off_kv_len": 0, "off_gathered_kv_indptr": batch, "off_vt_block": 2 * batch + 1}
    image = torch.full((3 * batch + 2,), -1, dtype=torch.int32)
    image[:batch] = torch.tensor(KV_LENS, dtype=torch.int32)
    return Schedule(image, image.numel(), offsets, tile, 132, 64, 64, 0, num_partials, may_gather, may_transpose_v)


def test_workspace_holds_partials_then_gathered_pages_then_v_transposed():
    r = paged(qo_indptr=_indptr((3000, 3000, 3000)), num_qo_heads=32, num_kv_heads=8)
    o = options(q_data_type=torch.float8_e4m3fn)
    sched = schedule_of(r, num_partials=10, may_gather=True, may_transpose_v=True)
    space = carve_workspace(r, o, sched, torch.empty(64 << 20, dtype=torch.uint8), graph=False)
    v_bytes = -(-10 * 32 * 128 * 4 // 256) * 256
    assert space.v_bytes == v_bytes
    assert space.gathered_offset == -(-(v_bytes + 10 * 32 * 4) // 1024) * 1024
    assert space.gathered_pages == r.total_kv
    assert space.vt_offset == space.gathered_offset + gathered_kv_bytes(r.total_kv * PAGE, 8, 256, 1)
    blocks = [-(-n // VT_BLOCK_KEYS) for n in KV_LENS]
    assert space.transposes_v and space.vt_blocks == sum(blocks)
    assert sched.image[3:7].tolist() == [0, 3 * PAGE, 4 * PAGE, 11 * PAGE]  # each request's first gathered row
    assert sched.image[7:11].tolist() == [0, blocks[0], blocks[0] + blocks[1], sum(blocks)]


def test_workspace_without_room_for_v_transposed_lets_the_kernel_transpose():
    r = paged(qo_indptr=_indptr((3000, 3000, 3000)), num_qo_heads=32, num_kv_heads=8)
    o = options(q_data_type=torch.float8_e4m3fn)
    space = carve_workspace(r, o, schedule_of(r, may_transpose_v=True), torch.empty(4096, dtype=torch.uint8),
                            graph=False)
    assert (space.transposes_v, space.vt_blocks, space.gathered_pages) == (False, 0, 0)


def test_workspace_too_small_for_the_partials_says_how_large():
    r = paged()
    with pytest.raises(ValueError, match=r"float_workspace_buffer: this plan needs 4128 bytes for split-KV "
                                         r"partials, the buffer has 4096"):
        carve_workspace(r, options(), schedule_of(r, num_partials=1), torch.empty(4096, dtype=torch.uint8), False)


@pytest.mark.parametrize("wrapper", ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper"])
def test_every_kernel_option_is_a_plan_parameter(wrapper):
    """plan() hands its options to check_options by name: each must be one of its parameters."""
    import inspect

    import attnforge
    from attnforge.prefill import _OPTION_ARGS

    parameters = inspect.signature(getattr(attnforge, wrapper).plan).parameters
    assert set(_OPTION_ARGS) <= set(parameters)
    assert set(_OPTION_ARGS) | {"head_dim_qk"} == set(inspect.signature(check_options).parameters)
