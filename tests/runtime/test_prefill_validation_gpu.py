"""Batch prefill wrappers' argument errors on a GPU: each bad argument to plan() or run() raises
with a message naming the argument. One small valid batch (bf16, 8 query heads over 2 kv heads,
head dim 128, pages of 16, 3 requests) is the base every test perturbs in exactly one place."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import attnforge
from attnforge.codegen.rules import UnsupportedSpecError

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HQ, HKV, HD, PAGE = 8, 2, 128, 16
QO_LENS, KV_LENS = (5, 1, 40), (37, 16, 100)
NUM_PAGES = 16


def _indptr(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


@pytest.fixture(scope="module")
def base():
    gen = torch.Generator(device="cpu").manual_seed(0)
    pages = [-(-n // PAGE) for n in KV_LENS]
    page_ids = torch.randperm(NUM_PAGES, generator=gen)[: sum(pages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(KV_LENS, pages)], dtype=torch.int32)
    cache = tuple(torch.randn(NUM_PAGES, PAGE, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16) for _ in "kv")
    k, v = (torch.randn(sum(KV_LENS), HKV, HD, generator=gen).to(DEVICE, torch.bfloat16) for _ in "kv")
    q = torch.randn(sum(QO_LENS), HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    return SimpleNamespace(qo_indptr=_indptr(QO_LENS), kv_indptr=_indptr(KV_LENS), page_indptr=_indptr(pages),
                           page_ids=page_ids, last=last, cache=cache, k=k, v=v, q=q)


def workspace(nbytes: int = 64 << 20) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)


def plan_paged(base, w=None, **overrides):
    w = w or attnforge.BatchPrefillWithPagedKVCacheWrapper(workspace())
    args = dict(qo_indptr=base.qo_indptr, paged_kv_indptr=base.page_indptr, paged_kv_indices=base.page_ids,
                paged_kv_last_page_len=base.last, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=HD, page_size=PAGE,
                q_data_type=torch.bfloat16)
    args.update(overrides)
    w.plan(**args)
    return w


def plan_ragged(base, **overrides):
    w = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    args = dict(qo_indptr=base.qo_indptr, kv_indptr=base.kv_indptr, num_qo_heads=HQ, num_kv_heads=HKV,
                head_dim_qk=HD, q_data_type=torch.bfloat16)
    args.update(overrides)
    w.plan(**args)
    return w


@contextlib.contextmanager
def raises(exc, *texts):
    """pytest.raises that also checks the message names what it should."""
    with pytest.raises(exc) as info:
        yield info
    for text in texts:
        assert text in str(info.value), f"{text!r} not in {str(info.value)!r}"


def test_valid_base_runs(base):
    out = plan_paged(base).run(base.q, base.cache)
    assert out.shape == (sum(QO_LENS), HQ, HD) and not out.isnan().any()
    out = plan_ragged(base).run(base.q, base.k, base.v)
    assert out.shape == (sum(QO_LENS), HQ, HD) and not out.isnan().any()


def test_run_before_plan(base):
    with raises(RuntimeError, "before plan()"):
        attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace()).run(base.q, base.k, base.v)


@pytest.mark.parametrize("bad, text", [
    (torch.tensor([0, 5, 3, 46], dtype=torch.int32), "qo_indptr"),
    (torch.tensor([1, 5, 6, 46], dtype=torch.int32), "qo_indptr"),
    (torch.tensor([0, 5, 6, 46], dtype=torch.int64), "qo_indptr"),
])
def test_plan_bad_qo_indptr(base, bad, text):
    with raises(ValueError, text):
        plan_ragged(base, qo_indptr=bad)


def test_plan_kv_indptr_decreasing(base):
    with raises(ValueError, "kv_indptr"):
        plan_ragged(base, kv_indptr=torch.tensor([0, 37, 20, 153], dtype=torch.int32))


def test_plan_kv_indptr_wrong_length(base):
    with raises(ValueError, "kv_indptr", "4 entries"):
        plan_ragged(base, kv_indptr=torch.tensor([0, 37, 53], dtype=torch.int32))


@pytest.mark.parametrize("value", [0, PAGE + 1])
def test_plan_last_page_len_out_of_range(base, value):
    last = base.last.clone()
    last[1] = value
    with raises(ValueError, "last_page_len"):
        plan_paged(base, paged_kv_last_page_len=last)


def test_plan_page_indptr_beyond_indices(base):
    with raises(ValueError, "indptr"):
        plan_paged(base, paged_kv_indices=base.page_ids[:3])


def test_plan_heads_not_divisible(base):
    with raises(ValueError, "num_qo_heads=7", "num_kv_heads=2"):
        plan_ragged(base, num_qo_heads=7)


def test_plan_head_dim_without_kernel_names_the_rule(base):
    with raises(UnsupportedSpecError, "fa2-prefill-head-dims"):
        plan_ragged(base, head_dim_qk=144)  # a multiple of 16 no kernel lists


def test_plan_fp8_kv_with_explicit_fa3_names_the_rule(base):
    w = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend="fa3")
    with raises(UnsupportedSpecError, "fa3-fp8-kv-needs-fp8-q", "fa2"):
        w.plan(base.qo_indptr, base.kv_indptr, HQ, HKV, HD, q_data_type=torch.bfloat16,
               kv_data_type=torch.float8_e4m3fn)


def test_plan_explicit_fa3_that_a_rule_refuses_names_the_rule(base):
    w = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend="fa3")
    with raises(UnsupportedSpecError, "fa3-", "use"):
        w.plan(base.qo_indptr, base.kv_indptr, HQ, HKV, HD, pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.bfloat16)


def test_plan_custom_mask_wrong_size(base):
    bits = sum(a * b for a, b in zip(QO_LENS, KV_LENS))
    with raises(ValueError, "custom_mask", str(bits)):
        plan_ragged(base, custom_mask=torch.ones(bits - 1, dtype=torch.bool))


def test_plan_packed_mask_wrong_size(base):
    with raises(ValueError, "packed_custom_mask"):
        plan_ragged(base, packed_custom_mask=torch.ones(3, dtype=torch.uint8))


def test_plan_fp16_qk_reduction_is_refused(base):
    with raises(ValueError, "use_fp16_qk_reduction", "fp32"):
        plan_ragged(base, use_fp16_qk_reduction=True)


def test_plan_causal_with_custom_mask_the_mask_wins(base):
    """FlashInfer: causal applies only without a mask. An all-true mask with causal=True attends to
    every key, so it equals the non-causal run, and differs from the causal one."""
    bits = sum(a * b for a, b in zip(QO_LENS, KV_LENS))
    mask = torch.ones(bits, dtype=torch.bool)
    masked = plan_ragged(base, causal=True, custom_mask=mask).run(base.q, base.k, base.v)
    full = plan_ragged(base, causal=False).run(base.q, base.k, base.v)
    causal = plan_ragged(base, causal=True).run(base.q, base.k, base.v)
    torch.testing.assert_close(masked, full, atol=1e-2, rtol=1e-2)
    assert (masked - causal).abs().max() > 1e-2


def test_plan_workspace_too_small_says_how_large(base):
    w = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace(1024))
    with raises(ValueError, "float_workspace_buffer", "bytes"):
        w.plan(base.qo_indptr, base.kv_indptr, HQ, HKV, HD, q_data_type=torch.bfloat16, fixed_split_size=16)


def test_plan_unsupported_flashinfer_argument(base):
    with raises(ValueError, "prefix_len_ptr"):
        plan_ragged(base, prefix_len_ptr=torch.zeros(3, dtype=torch.int32))
    plan_ragged(base, token_pos_in_items_len=0)  # FlashInfer's default is accepted


def test_plan_unknown_argument(base):
    with raises(TypeError, "casual"):
        plan_ragged(base, casual=True)


def test_run_q_rows_must_match_qo_indptr(base):
    with raises(ValueError, "q", "qo_indptr[-1]"):
        plan_ragged(base).run(base.q[:-1], base.k, base.v)


def test_run_q_dtype_must_match_plan(base):
    with raises(ValueError, "q", "torch.bfloat16"):
        plan_ragged(base).run(base.q.half(), base.k, base.v)


def test_run_ragged_kv_wrong_length(base):
    with raises(ValueError, "k", "kv_indptr[-1]"):
        plan_ragged(base).run(base.q, base.k[:-1], base.v)


def test_run_out_wrong_dtype(base):
    with raises(ValueError, "out", "o_data_type"):
        plan_ragged(base).run(base.q, base.k, base.v, out=torch.empty_like(base.q, dtype=torch.float16))


def test_run_lse_wrong_shape(base):
    with raises(ValueError, "lse"):
        plan_ragged(base).run(base.q, base.k, base.v, return_lse=True,
                              lse=torch.empty(3, HQ, dtype=torch.float32, device=DEVICE))


def test_run_host_page_id_out_of_range(base):
    ids = base.page_ids.clone()
    ids[0] = NUM_PAGES + 3
    with raises(ValueError, "paged_kv_indices", str(NUM_PAGES + 3)):
        plan_paged(base, paged_kv_indices=ids).run(base.q, base.cache)


def test_run_paged_cache_wrong_heads(base):
    k, v = (c[:, :, :1] for c in base.cache)
    with raises(ValueError, "k_cache"):
        plan_paged(base).run(base.q, (k, v))


def test_run_window_must_match_plan(base):
    with raises(ValueError, "window_left"):
        plan_ragged(base).run(base.q, base.k, base.v, window_left=16)
