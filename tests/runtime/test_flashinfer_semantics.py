"""FlashInfer argument meanings on CPU: data_type fills only the dtypes left None, a positional
caller binds every value to FlashInfer's parameter, arguments FlashInfer accepts are accepted
(refused ones name themselves), fast_decode_plan re-plans through the wrapper's planning path, and
forward()'s knobs replace the planned ones.

The wrappers' constructors need a CUDA workspace, so the tests build them with object.__new__ and
stop plan() at its first step past argument binding: the decode wrapper's _plan_from (which gets
the DecodePlanInputs record) and the prefill plan's check_request/check_options (which get every
argument by name). Everything before those seams is the code under test.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import attnforge
from attnforge import call_knobs, decode, prefill
from attnforge.decode_inputs import DecodePlanInputs, check_kv_covers_queries, resolve_data_type
from attnforge.decode_graph import fast_decode_plan
from attnforge.plan_buffers import score_scales


class Stop(Exception):
    """Raised by a capturing seam once it holds plan()'s arguments."""


def _decode_capturing(monkeypatch, planned: DecodePlanInputs | None = None, tensor_cores: bool = False):
    wrapper = object.__new__(attnforge.BatchDecodeWithPagedKVCacheWrapper)
    wrapper._plan_inputs = planned
    wrapper._tensor_cores = object() if tensor_cores else None
    calls = []
    monkeypatch.setattr(wrapper, "_plan_from", lambda inputs, host_indptr=None, reuse=False:
                        calls.append((inputs, host_indptr, reuse)), raising=False)
    return wrapper, calls


PAGE_TABLE = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32),
              torch.tensor([5], dtype=torch.int32))


# ----------------------------------------------------------------------------- data_type
@pytest.mark.parametrize("q, kv, data_type, expected", [
    ("float16", None, None, ("float16", None)),
    ("float16", None, torch.float8_e4m3fn, ("float16", torch.float8_e4m3fn)),  # an fp16 query over an fp8 cache
    (None, None, torch.bfloat16, (torch.bfloat16, torch.bfloat16)),
    (torch.bfloat16, torch.float8_e5m2, torch.float16, (torch.bfloat16, torch.float8_e5m2)),
    (None, None, None, ("float16", None)),
])
def test_data_type_fills_only_what_is_left_none(q, kv, data_type, expected):
    assert resolve_data_type(q, kv, data_type) == expected


def test_decode_plan_data_type_keeps_the_fp16_query(monkeypatch):
    """The issue's case: plan(data_type=e4m3, q_data_type=fp16) plans an fp16 query over an fp8 cache."""
    wrapper, calls = _decode_capturing(monkeypatch)
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, data_type=torch.float8_e4m3fn, q_data_type=torch.float16)
    inputs = calls[0][0]
    assert (inputs.q_data_type, inputs.kv_data_type) == (torch.float16, torch.float8_e4m3fn)
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, data_type=torch.bfloat16)  # q_data_type keeps its default
    assert (calls[1][0].q_data_type, calls[1][0].kv_data_type) == ("float16", torch.bfloat16)


# ----------------------------------------------------------------------------- positional binding
def test_decode_plan_positional_binding(monkeypatch):
    wrapper, calls = _decode_capturing(monkeypatch)
    # FlashInfer 0.7.4's order after page_size: pos_encoding_mode, window_left, logits_soft_cap,
    # q_data_type, kv_data_type, o_data_type, data_type, sm_scale, rope_scale, rope_theta,
    # non_blocking, block_tables, seq_lens, fixed_split_size, disable_split_kv, q_len_per_req
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, "ROPE_LLAMA", 11, 12.0, "QD", "KVD", "OD", "DD", 0.13, 0.14, 15.0,
                 False, None, None, 16, True, 1)
    got = calls[0][0]
    assert (got.indptr, got.indices, got.last_page_len) == PAGE_TABLE
    assert (got.num_qo_heads, got.num_kv_heads, got.head_dim, got.page_size) == (8, 2, 128, 16)
    assert (got.pos_encoding_mode, got.window_left, got.logits_soft_cap) == ("ROPE_LLAMA", 11, 12.0)
    assert (got.q_data_type, got.kv_data_type, got.o_data_type) == ("QD", "KVD", "OD")
    assert (got.sm_scale, got.rope_scale, got.rope_theta) == (0.13, 0.14, 15.0)
    assert (got.fixed_split_size, got.disable_split_kv) == (16, True)
    # data_type in its slot (7th after page_size) fills the dtypes left None
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, "NONE", -1, None, None, None, None, "DD")
    assert (calls[1][0].q_data_type, calls[1][0].kv_data_type) == ("DD", "DD")


def _prefill_capturing(monkeypatch, cls):
    captured = {}

    def check_request(**kwargs):
        captured["request"] = kwargs
        return dataclasses.make_dataclass("R", ["head_dim_qk"])(kwargs["head_dim_qk"])

    def check_options(**kwargs):
        captured["options"] = kwargs
        raise Stop

    monkeypatch.setattr(prefill, "check_request", check_request)
    monkeypatch.setattr(prefill, "check_options", check_options)
    return object.__new__(cls), captured


OPTION_VALUES = dict(head_dim_vo=96, custom_mask="CM", packed_custom_mask=None, causal="CAUSAL",
                     pos_encoding_mode="POS", use_fp16_qk_reduction="FP16QK", sm_scale=0.21, window_left=22,
                     logits_soft_cap=23.0, rope_scale=0.24, rope_theta=25.0, q_data_type="QD", kv_data_type="KVD",
                     o_data_type="OD")


def test_paged_prefill_plan_positional_binding(monkeypatch):
    wrapper, captured = _prefill_capturing(monkeypatch, attnforge.BatchPrefillWithPagedKVCacheWrapper)
    v = OPTION_VALUES
    with pytest.raises(Stop):
        wrapper.plan("QO", "KVP", "IDX", "LAST", 8, 2, 128, 16, v["head_dim_vo"], v["custom_mask"],
                     v["packed_custom_mask"], v["causal"], v["pos_encoding_mode"], v["use_fp16_qk_reduction"],
                     v["sm_scale"], v["window_left"], v["logits_soft_cap"], v["rope_scale"], v["rope_theta"],
                     v["q_data_type"], v["kv_data_type"], v["o_data_type"], False,  # non_blocking
                     None, None, 0, None, None, None, None, None, None,  # multi-item scoring .. max_sequence_kv
                     "SPLIT", "NOSPLIT", 4, False)  # fixed_split_size, disable_split_kv, uniform_q_len, token-head sf
    request, options = captured["request"], captured["options"]
    assert (request["qo_indptr"], request["kv_indptr"], request["indices"], request["last_page_len"]) == \
        ("QO", "KVP", "IDX", "LAST")
    assert (request["num_qo_heads"], request["num_kv_heads"], request["head_dim_qk"], request["page_size"],
            request["head_dim_vo"]) == (8, 2, 128, 16, 96)
    _assert_options_bound(options)


def _assert_options_bound(options: dict) -> None:
    """Each kernel option reached check_options under its own name."""
    for name, value in OPTION_VALUES.items():
        if name != "head_dim_vo":
            assert options[name] == value, name
    assert (options["fixed_split_size"], options["disable_split_kv"]) == ("SPLIT", "NOSPLIT")


def test_ragged_prefill_plan_positional_binding(monkeypatch):
    wrapper, captured = _prefill_capturing(monkeypatch, attnforge.BatchPrefillWithRaggedKVCacheWrapper)
    v = OPTION_VALUES
    with pytest.raises(Stop):
        # the ragged order differs from the paged one: window_left and logits_soft_cap come before sm_scale
        wrapper.plan("QO", "KV", 8, 2, 128, v["head_dim_vo"], v["custom_mask"], v["packed_custom_mask"], v["causal"],
                     v["pos_encoding_mode"], v["use_fp16_qk_reduction"], v["window_left"], v["logits_soft_cap"],
                     v["sm_scale"], v["rope_scale"], v["rope_theta"], v["q_data_type"], v["kv_data_type"],
                     v["o_data_type"], False, None, None, 0, None, "SPLIT", "NOSPLIT", None, None, None, None, None,
                     "O_INDPTR", None, None, 4, False)
    request, options = captured["request"], captured["options"]
    assert (request["qo_indptr"], request["kv_indptr"], request["head_dim_vo"]) == ("QO", "KV", 96)
    _assert_options_bound(options)


def test_ragged_plan_reads_the_host_mirrors(monkeypatch):
    wrapper, captured = _prefill_capturing(monkeypatch, attnforge.BatchPrefillWithRaggedKVCacheWrapper)
    with pytest.raises(Stop):
        wrapper.plan("QO_DEV", "KV_DEV", 8, 2, 128, qo_indptr_cpu="QO_HOST", kv_indptr_cpu="KV_HOST")
    assert (captured["request"]["qo_indptr"], captured["request"]["kv_indptr"]) == ("QO_HOST", "KV_HOST")


# ----------------------------------------------------------------------------- accepted / refused
def test_decode_plan_accepts_neutral_values_and_names_the_rest(monkeypatch):
    wrapper, calls = _decode_capturing(monkeypatch)
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, q_len_per_req=1, window_right=0, is_causal=None)
    assert len(calls) == 1
    for kwargs, text in ((dict(q_len_per_req=2), "q_len_per_req=2: .*use_tensor_cores=True"),
                         (dict(q_len_per_req=0), r"q_len_per_req: expected an int in \[1, 2147483647\] .*, got 0"),
                         (dict(is_causal=True), "is_causal=True: decode is causal exactly when q_len_per_req > 1"),
                         (dict(window_right=3), "window_right"), (dict(use_token_head_sf=True), "use_token_head_sf"),
                         (dict(block_tables=torch.zeros(1, 1)), "block_tables")):
        with pytest.raises(ValueError, match=text):
            wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, **kwargs)
    assert len(calls) == 1


def test_multi_token_decode_plans_on_tensor_cores(monkeypatch):
    wrapper, calls = _decode_capturing(monkeypatch, tensor_cores=True)
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, q_len_per_req=3)
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, q_len_per_req=2, is_causal=True)
    assert [inputs.q_len_per_req for inputs, _, _ in calls] == [3, 2]
    assert calls[0][0].knobs_key() != calls[1][0].knobs_key()  # a re-plan never reuses another q_len's knobs
    with pytest.raises(ValueError, match="is_causal=False"):
        wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, q_len_per_req=2, is_causal=False)


def test_decode_run_q_len_must_be_the_planned_one():
    wrapper = object.__new__(attnforge.BatchDecodeWithPagedKVCacheWrapper)
    wrapper._plan_inputs = _inputs(q_len_per_req=2)
    with pytest.raises(ValueError, match="q_len_per_req: plan\\(\\) was given 2, run\\(\\) 3"):
        wrapper.run(torch.zeros(1), None, q_len_per_req=3)


@pytest.mark.parametrize("indptr, last, q_len, bad", [
    ([0, 1, 3], [2, 16], 3, 0),  # request 0: one page holding 2 tokens < 3
    ([0, 2, 2], [1, 5], 2, 1),  # request 1: no pages
    ([0, 1, 3], [3, 1], 3, None),  # 3 and 17 tokens: enough
])
def test_multi_token_decode_needs_kv_holding_the_queries(indptr, last, q_len, bad):
    args = (torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), 16, q_len)
    if bad is None:
        check_kv_covers_queries(*args)
        return
    with pytest.raises(ValueError, match=f"request {bad} has"):
        check_kv_covers_queries(*args)


def test_prefill_plan_refuses_unsupported_features_by_name(monkeypatch):
    wrapper, _ = _prefill_capturing(monkeypatch, attnforge.BatchPrefillWithPagedKVCacheWrapper)
    with pytest.raises(ValueError, match="prefix_len_ptr.*not supported"):
        wrapper.plan("QO", "KVP", "IDX", "LAST", 8, 2, 128, 16, prefix_len_ptr=torch.zeros(1))
    ragged, _ = _prefill_capturing(monkeypatch, attnforge.BatchPrefillWithRaggedKVCacheWrapper)
    with pytest.raises(ValueError, match="use_token_head_sf.*not supported"):
        ragged.plan("QO", "KV", 8, 2, 128, use_token_head_sf=True)
    with pytest.raises(TypeError):
        ragged.plan("QO", "KV", 8, 2, 128, not_a_flashinfer_argument=1)


# ----------------------------------------------------------------------------- fast_decode_plan
def _inputs(**overrides) -> DecodePlanInputs:
    base = dict(indptr=PAGE_TABLE[0], indices=PAGE_TABLE[1], last_page_len=PAGE_TABLE[2], num_qo_heads=8,
                num_kv_heads=2, head_dim=128, page_size=16, pos_encoding_mode="NONE", window_left=-1,
                logits_soft_cap=None, q_data_type=torch.bfloat16, kv_data_type=None, o_data_type=torch.float32,
                sm_scale=None, rope_scale=None, rope_theta=None, fixed_split_size=None, disable_split_kv=False)
    base.update(overrides)
    return DecodePlanInputs(**base)


def test_fast_decode_plan_replans_through_the_wrapper(monkeypatch):
    wrapper, calls = _decode_capturing(monkeypatch, planned=_inputs())
    wrapper.plan = lambda *a, **k: fast_decode_plan(wrapper, *a, **k)  # as engines install it (functools.partial)
    host = torch.tensor([0, 2], dtype=torch.int32)
    wrapper.plan(*PAGE_TABLE, 8, 2, 128, 16, "NONE", -1, None, torch.bfloat16, None, None, None, None, None, True,
                 None, False, 1, host)
    inputs, host_indptr, reuse = calls[0]
    assert host_indptr is host and reuse is True
    assert inputs.knobs_key() == _inputs().knobs_key()  # o_data_type carried over from the previous plan
    fast_decode_plan(wrapper, *PAGE_TABLE, 8, 2, 128, 16, data_type=torch.float16)
    assert (calls[1][0].q_data_type, calls[1][0].kv_data_type) == (torch.float16, torch.float16)
    with pytest.raises(ValueError, match="q_len_per_req=3: .*use_tensor_cores=True"):
        fast_decode_plan(wrapper, *PAGE_TABLE, 8, 2, 128, 16, q_len_per_req=3)


def test_fast_decode_plan_without_a_previous_plan_is_a_full_plan(monkeypatch):
    wrapper, calls = _decode_capturing(monkeypatch)
    fast_decode_plan(wrapper, *PAGE_TABLE, 8, 2, 128, 16)
    assert calls[0][2] is False and calls[0][0].q_data_type == "float16"


# ----------------------------------------------------------------------------- forward() knobs
def test_call_knobs_compare_meanings():
    planned = call_knobs.normalized(128, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
                                    sm_scale=None, rope_scale=None, rope_theta=None, causal=False)
    same = call_knobs.normalized(128, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=0.0,
                                 sm_scale=128 ** -0.5, rope_scale=1.0, rope_theta=1e4, causal=False)
    assert call_knobs.changed(same, planned) == []
    other = dict(same, causal=True, sm_scale=0.5)
    assert call_knobs.changed(other, planned) == ["sm_scale", "causal"]
    assert call_knobs.needs_new_plan(["causal"], other, planned)
    assert not call_knobs.needs_new_plan(["sm_scale"], other, planned)
    capped = dict(same, soft_cap=30.0)
    assert call_knobs.needs_new_plan(["soft_cap"], capped, planned)  # turning a soft cap on selects another kernel
    assert not call_knobs.needs_new_plan(["soft_cap"], dict(same, soft_cap=20.0), capped)


def test_decode_forward_knobs_replace_the_planned_ones(monkeypatch):
    wrapper, calls = _decode_capturing(monkeypatch, planned=_inputs())
    wrapper._plan_call, wrapper._tensor_cores = (None, False), None
    wrapper._plan = SimpleNamespace(sm_scale=128 ** -0.5, soft_cap=0.0, scales=(2.0, 1.0), params=SimpleNamespace())
    wrapper._apply_call_knobs(pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, sm_scale=0.5,
                              rope_scale=None, rope_theta=None)
    assert calls == [] and wrapper._plan.sm_scale == 0.5  # a run-time scalar: no new plan
    # the kernel's scale follows at once, with the last run's q_scale still folded in
    assert wrapper._plan.params.score_scale == score_scales(0.5 * 2.0, 0.0)[0]
    wrapper._apply_call_knobs(pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=30.0, sm_scale=None,
                              rope_scale=None, rope_theta=None)
    assert len(calls) == 1 and calls[0][0].logits_soft_cap == 30.0 and calls[0][0].sm_scale is None
    assert calls[0][0].indptr is PAGE_TABLE[0]  # the same page table, planned again


def test_forward_before_plan_says_so():
    wrapper = object.__new__(attnforge.BatchDecodeWithPagedKVCacheWrapper)
    wrapper._plan_inputs = None
    with pytest.raises(RuntimeError, match="forward\\(\\) called before plan\\(\\)"):
        wrapper.forward(torch.zeros(1), None)
    ragged = object.__new__(attnforge.BatchPrefillWithRaggedKVCacheWrapper)
    ragged._planned = None
    with pytest.raises(RuntimeError, match="forward\\(\\) called before plan\\(\\)"):
        ragged.forward_return_lse(torch.zeros(1), None, None, causal=True)


# ----------------------------------------------------------------------------- cascade
def test_merge_state_in_place_with_mask():
    gen = torch.Generator().manual_seed(1)
    v, v_other = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    s, s_other = torch.randn(5, 2, generator=gen), torch.randn(5, 2, generator=gen)
    mask = torch.tensor([True, False, True, True, False])
    merged_v, merged_s = attnforge.merge_state(v, s, v_other, s_other)
    v_in, s_in = v.clone(), s.clone()
    attnforge.cascade.merge_state_in_place(v_in, s_in, v_other, s_other, mask)
    torch.testing.assert_close(v_in[mask], merged_v[mask])
    torch.testing.assert_close(s_in[mask], merged_s[mask])
    assert torch.equal(v_in[~mask], v[~mask]) and torch.equal(s_in[~mask], s[~mask])
    with pytest.raises(ValueError, match="mask: expected a bool tensor of shape \\(5,\\)"):
        attnforge.cascade.merge_state_in_place(v_in, s_in, v_other, s_other, mask[:3])


def test_decode_module_exposes_graph_names():
    assert decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper is attnforge.CUDAGraphBatchDecodeWithPagedKVCacheWrapper
    assert decode.fast_decode_plan is fast_decode_plan
