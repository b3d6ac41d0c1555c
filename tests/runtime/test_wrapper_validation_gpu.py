"""BatchDecodeWithPagedKVCacheWrapper argument errors on a GPU: each bad argument to plan() or
run() raises the documented exception with a message that names the argument. One small valid
batch (bf16, 8 query heads over 2 kv heads, head dim 128, pages of 16, 3 requests) is the base
every test perturbs in exactly one place."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import attnforge
from attnforge import reference
from attnforge.codegen.abi import PLAN_HEADER
from attnforge.codegen.rules import UnsupportedSpecError

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HQ, HKV, HD, PAGE = 8, 2, 128, 16
KV_LENS = (37, 16, 100)  # pages 3, 1, 7
NUM_PAGES = 16
WORKSPACE_BYTES = 64 << 20


def _page_table(kv_lens, page_size):
    indptr, last = [0], []
    for kv in kv_lens:
        pages = -(-kv // page_size)
        indptr.append(indptr[-1] + pages)
        last.append(kv - (pages - 1) * page_size if pages else 0)
    return torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32)


@pytest.fixture(scope="module")
def base():
    gen = torch.Generator(device="cpu").manual_seed(0)
    indptr, last_page_len = _page_table(KV_LENS, PAGE)
    used = int(indptr[-1])
    indices = torch.randperm(NUM_PAGES, generator=gen)[:used].to(torch.int32)
    k = torch.randn(NUM_PAGES, PAGE, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(NUM_PAGES, PAGE, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    q = torch.randn(len(KV_LENS), HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    return SimpleNamespace(indptr=indptr, last_page_len=last_page_len, host_indices=indices,
                           indices=indices.to(DEVICE), k=k, v=v, q=q)


def wrapper(workspace_bytes: int = WORKSPACE_BYTES, **kwargs):
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=DEVICE)
    return attnforge.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kwargs)


def plan_args(base, **overrides) -> dict:
    args = dict(indptr=base.indptr, indices=base.indices, last_page_len=base.last_page_len, num_qo_heads=HQ,
                num_kv_heads=HKV, head_dim=HD, page_size=PAGE, q_data_type=torch.bfloat16)
    args.update(overrides)
    return args


def planned(base, **overrides):
    w = wrapper()
    w.plan(**plan_args(base, **overrides))
    return w


def refuse_plan(base, exc, *texts, w=None, **overrides) -> str:
    w = w or wrapper()
    with pytest.raises(exc) as info:
        w.plan(**plan_args(base, **overrides))
    message = str(info.value)
    for text in texts:
        assert text in message, f"{text!r} not in {message!r}"
    return message


def refuse_run(w, exc, *texts, args=(), **kwargs) -> str:
    with pytest.raises(exc) as info:
        w.run(*args, **kwargs)
    message = str(info.value)
    for text in texts:
        assert text in message, f"{text!r} not in {message!r}"
    return message


# ---------------------------------------------------------------- the valid base


def test_base_batch_runs_and_matches_reference(base):
    w = planned(base)
    out, lse = w.run(base.q, (base.k, base.v), return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == base.q.shape
    ref_o, ref_lse = reference.batch_decode_paged(base.q.float(), (base.k.float(), base.v.float()), base.indptr,
                                                  base.indices, base.last_page_len)
    torch.testing.assert_close(out.float(), ref_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


# ---------------------------------------------------------------- plan()


def test_plan_indptr_wrong_dtype(base):
    refuse_plan(base, ValueError, "indptr", "torch.int32", "torch.int64", indptr=base.indptr.to(torch.int64))


def test_plan_indptr_two_dimensional(base):
    refuse_plan(base, ValueError, "indptr", "1-D", indptr=base.indptr.view(1, -1))


def test_plan_indptr_decreasing(base):
    indptr = base.indptr.clone()
    indptr[2] = indptr[1] - 1  # [0, 3, 2, 11]
    message = refuse_plan(base, ValueError, "indptr[2]", "non-decreasing", indptr=indptr)
    assert message.startswith("plan(): ")


def test_plan_last_page_len_wrong_length(base):
    refuse_plan(base, ValueError, "last_page_len", "3 entries", "got 2", last_page_len=base.last_page_len[:2])


def test_plan_last_page_len_zero_for_non_empty_request(base):
    last = base.last_page_len.clone()
    last[1] = 0
    refuse_plan(base, ValueError, "last_page_len[1]", f"page_size={PAGE}", last_page_len=last)


def test_plan_last_page_len_above_page_size(base):
    last = base.last_page_len.clone()
    last[2] = PAGE + 1
    refuse_plan(base, ValueError, "last_page_len[2]", f"= {PAGE + 1}", f"page_size={PAGE}", last_page_len=last)


def test_plan_indptr_beyond_indices(base):
    short = base.indices[: int(base.indptr[-1]) - 1]
    refuse_plan(base, ValueError, "indptr[-1]", f"only {short.numel()} page ids", indices=short)


def test_plan_heads_not_a_multiple(base):
    refuse_plan(base, ValueError, "num_qo_heads=7", "num_kv_heads=2", num_qo_heads=7)


def test_plan_head_dim_without_kernel(base):
    message = refuse_plan(base, UnsupportedSpecError, "decode-head-dims", head_dim=144)
    assert "144" in message


def test_plan_window_left_below_minus_one(base):
    refuse_plan(base, ValueError, "window_left", "-2", window_left=-2)


def test_plan_negative_soft_cap(base):
    refuse_plan(base, ValueError, "logits_soft_cap", "-1", logits_soft_cap=-1.0)


def test_plan_zero_sm_scale(base):
    refuse_plan(base, ValueError, "sm_scale", "0", sm_scale=0.0)


def test_plan_with_fa3_backend_refused_by_rule(base):
    w = wrapper(backend="fa3")
    message = refuse_plan(base, UnsupportedSpecError, "decode-is-fa2", w=w)
    assert "use backend fa2" in message


def test_plan_fp8_output_refused(base):
    refuse_plan(base, UnsupportedSpecError, "o-not-fp8", o_data_type=torch.float8_e4m3fn)


def test_plan_mixed_16bit_refused(base):
    refuse_plan(base, UnsupportedSpecError, "mixed-16bit-qkv", q_data_type=torch.bfloat16, kv_data_type=torch.float16)


def test_plan_workspace_too_small(base):
    # fixed_split_size=1 cuts requests into 16-token chunks: requests 0 and 2 need 3 + 7 partial slots.
    w = wrapper(workspace_bytes=1024)
    message = refuse_plan(base, ValueError, "float_workspace_buffer", "has 1024", "decode_workspace_size",
                          w=w, fixed_split_size=1)
    needed = int(re.search(r"needs (\d+) bytes", message).group(1))
    assert needed >= 10 * HQ * HD * 4 > 1024


# ---------------------------------------------------------------- run()


def test_run_before_plan(base):
    refuse_run(wrapper(), RuntimeError, "before plan", args=(base.q, (base.k, base.v)))


def test_run_q_wrong_dtype(base):
    refuse_run(planned(base), ValueError, "q", "torch.bfloat16", "torch.float16",
               args=(base.q.half(), (base.k, base.v)))


def test_run_q_wrong_shape(base):
    refuse_run(planned(base), ValueError, "q", f"(3, {HQ}, {HD})", f"(3, {HQ}, 64)",
               args=(base.q[..., :64].contiguous(), (base.k, base.v)))


def test_run_q_on_cpu(base):
    refuse_run(planned(base), ValueError, "q", "cuda", "cpu", args=(base.q.cpu(), (base.k, base.v)))


def test_run_q_last_dim_not_contiguous(base):
    q = base.q.transpose(1, 2).contiguous().transpose(1, 2)  # shape [3, 8, 128], stride(-1) == 8
    assert q.shape == base.q.shape and q.stride(-1) != 1
    refuse_run(planned(base), ValueError, "q", "last dimension", args=(q, (base.k, base.v)))


def test_run_kv_wrong_dtype(base):
    refuse_run(planned(base), ValueError, "k_cache", "torch.bfloat16", "torch.float16",
               args=(base.q, (base.k.half(), base.v.half())))


def test_run_kv_wrong_layout(base):
    k, v = base.k.transpose(1, 2).contiguous(), base.v.transpose(1, 2).contiguous()  # HND given to an NHD wrapper
    refuse_run(planned(base), ValueError, "k_cache", "NHD", f"({NUM_PAGES}, {HKV}, {PAGE}, {HD})", args=(base.q, (k, v)))


def test_run_kv_different_shapes(base):
    v = torch.cat([base.v, base.v[:4]])
    refuse_run(planned(base), ValueError, "paged_kv_cache", "same number of pages", args=(base.q, (base.k, v)))


def test_run_kv_three_tuple(base):
    refuse_run(planned(base), ValueError, "paged_kv_cache", "pair", "3", args=(base.q, (base.k, base.v, base.v)))


def test_run_out_wrong_dtype(base):
    out = torch.empty_like(base.q, dtype=torch.float16)
    refuse_run(planned(base), ValueError, "out", "torch.bfloat16", args=(base.q, (base.k, base.v)), out=out)


def test_run_out_wrong_shape(base):
    out = torch.empty(3, HQ, 64, dtype=torch.bfloat16, device=DEVICE)
    refuse_run(planned(base), ValueError, "out", "same as q", args=(base.q, (base.k, base.v)), out=out)


def test_run_lse_wrong_dtype(base):
    lse = torch.empty(3, HQ, dtype=torch.bfloat16, device=DEVICE)
    refuse_run(planned(base), ValueError, "lse", "torch.float32", "torch.bfloat16",
               args=(base.q, (base.k, base.v)), lse=lse, return_lse=True)


def test_run_host_page_id_out_of_range(base):
    indices = base.host_indices.clone()
    indices[4] = NUM_PAGES
    w = planned(base, indices=indices)
    refuse_run(w, ValueError, "indices", "out of range", str(NUM_PAGES), args=(base.q, (base.k, base.v)))


def test_run_positional_extra_arguments_ignored_with_a_16_bit_query(base):
    """FlashInfer ignores extra positional run() arguments with a 16-bit query: so do we, warning once."""
    from attnforge import checks

    w = planned(base)
    expected = w.run(base.q, (base.k, base.v))
    checks._warned_extra_args = False
    with pytest.warns(UserWarning, match="extra positional argument"):
        got = w.run(base.q, (base.k, base.v), 1.0)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_run_window_left_mismatch(base):
    refuse_run(planned(base), ValueError, "window_left", "-1", "5", args=(base.q, (base.k, base.v)), window_left=5)


def test_run_v_scale(base):
    w = planned(base)
    plain = w.run(base.q, (base.k, base.v))
    scaled = w.run(base.q, (base.k, base.v), v_scale=2.0)
    torch.testing.assert_close(scaled.float(), plain.float() * 2.0, atol=1e-2, rtol=1e-2)
    assert torch.equal(w.run(base.q, (base.k, base.v), v_scale=1.0), plain)


# ---------------------------------------------------------------- workspace sizing


def test_decode_workspace_size_suffices_for_a_split_batch():
    kv_len, pages = 8192, 8192 // PAGE
    size = attnforge.decode_workspace_size(1, HQ, HKV, HD)
    assert size > 0
    gen = torch.Generator(device="cpu").manual_seed(1)
    k = torch.randn(pages, PAGE, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(pages, PAGE, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    q = torch.randn(1, HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    indptr = torch.tensor([0, pages], dtype=torch.int32)
    last = torch.tensor([PAGE], dtype=torch.int32)
    indices = torch.arange(pages, dtype=torch.int32, device=DEVICE)
    w = wrapper(workspace_bytes=size)
    w.plan(indptr, indices, last, HQ, HKV, HD, PAGE, q_data_type=torch.bfloat16)
    num_partials = w._image.read_slot(PLAN_HEADER.index("num_partials"))
    assert num_partials > 1, "a single 8k-token request should be split across the GPU"
    out = w.run(q, (k, v))
    ref, _ = reference.batch_decode_paged(q.float(), (k.float(), v.float()), indptr, indices, last)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert kv_len == pages * PAGE
