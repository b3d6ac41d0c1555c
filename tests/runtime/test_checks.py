"""Argument errors of the public API (CPU): every message names the argument, what was expected
and what was given, and refused specs name the rule and its suggestion."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnforge import checks, dispatch
from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import RULES_BY_ID, UnsupportedSpecError
from attnforge.codegen.spec import Arch, PosEncoding


def _raises(exc, fn, *args, contains=(), **kwargs) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for text in contains:
        assert text in message, f"{text!r} not in {message!r}"
    return message


def test_tensor_names_argument_and_given_type():
    _raises(TypeError, checks.tensor, [1, 2], "q", contains=("q", "torch.Tensor", "list"))
    x = torch.zeros(2)
    assert checks.tensor(x, "q") is x


def test_dtype_names_expected_given_and_why():
    x = torch.zeros(2, dtype=torch.float16)
    _raises(ValueError, checks.dtype, x, "k_cache", torch.bfloat16, "kv_data_type given to plan()",
            contains=("k_cache", "torch.bfloat16", "torch.float16", "kv_data_type given to plan()"))
    checks.dtype(x, "k_cache", torch.float16)


def test_device_names_expected_and_given():
    x = torch.zeros(2)
    _raises(ValueError, checks.device, x, "q", torch.device("cuda", 0), contains=("q", "cuda:0", "cpu"))
    checks.device(x, "q", torch.device("cpu"))


def test_shape_names_expected_given_and_layout():
    x = torch.zeros(2, 3, 4)
    _raises(ValueError, checks.shape, x, "q", (2, 3, 8), "[batch_size, num_qo_heads, head_dim]",
            contains=("q", "(2, 3, 8)", "(2, 3, 4)", "[batch_size, num_qo_heads, head_dim]"))
    checks.shape(x, "q", (2, 3, 4), "layout")


def test_vector_aligned_refuses_strided_last_dim_and_odd_strides():
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    checks.vector_aligned(x, "q")
    _raises(ValueError, checks.vector_aligned, x.t(), "q", contains=("q", "last dimension", "stride 1", "(1, 16)"))
    odd = torch.zeros(4, 20, dtype=torch.bfloat16)[:, :16]  # row stride 20: not a multiple of 8 elements
    _raises(ValueError, checks.vector_aligned, odd, "out", contains=("out", "16-byte", "multiple of 8", "(20, 1)"))
    shifted = torch.zeros(80, dtype=torch.bfloat16)[1:65].view(4, 16)  # storage 2 bytes off alignment
    _raises(ValueError, checks.vector_aligned, shifted, "k_cache", contains=("k_cache", "aligned"))


def test_host_int32_names_argument_expected_and_given():
    _raises(TypeError, checks.host_int32, [0, 1], "indptr", contains=("indptr", "torch.Tensor", "list"))
    _raises(ValueError, checks.host_int32, torch.zeros(3, dtype=torch.int64), "indptr",
            contains=("indptr", "torch.int32", "torch.int64"))
    _raises(ValueError, checks.host_int32, torch.zeros(2, 3, dtype=torch.int32), "indptr",
            contains=("indptr", "1-D", "(2, 3)"))
    _raises(ValueError, checks.host_int32, torch.zeros(3, dtype=torch.int32), "last_page_len", 4,
            contains=("last_page_len", "4 entries", "got 3"))
    strided = torch.arange(8, dtype=torch.int32)[::2]
    out = checks.host_int32(strided, "indptr", 4)
    assert out.is_contiguous() and out.tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "4", None])
def test_positive_int_names_argument_and_value(value):
    _raises(ValueError, checks.positive_int, value, "num_kv_heads", contains=("num_kv_heads", "expected an int in [1, 2147483647]", repr(value)))


def test_positive_int_accepts():
    assert checks.positive_int(7, "head_dim") == 7


@pytest.mark.parametrize("value", [0, -1.0, True, "2", float("nan")])
def test_scale_names_argument_and_value(value):
    _raises(ValueError, checks.scale, value, "v_scale", contains=("v_scale", "positive float", repr(value)))


def test_head_scale_takes_per_head_or_single_float32_tensors():
    cpu = torch.device("cpu")
    per_head = torch.rand(8)
    assert checks.head_scale(per_head, "q_scale", 8, cpu) == (per_head, None)
    one = torch.tensor([0.5])
    assert checks.head_scale(one, "k_scale", 4, cpu) == (one, None)
    assert checks.head_scale(2.0, "v_scale", 4, cpu) == (None, 2.0)
    assert checks.head_scale(None, "v_scale", 4, cpu) == (None, None)


@pytest.mark.parametrize("bad, given", [(torch.rand(3), "(3,)"), (torch.rand(4, 1), "(4, 1)"),
                                        (torch.rand(4, dtype=torch.float64), "torch.float64")])
def test_head_scale_names_expected_shape_and_dtype(bad, given):
    _raises(ValueError, checks.head_scale, bad, "k_scale", 4, torch.device("cpu"),
            contains=("k_scale", "float32", "[4]", "[1]", given))


def test_head_scale_refuses_other_device_and_strided_tensors():
    _raises(ValueError, checks.head_scale, torch.rand(4), "q_scale", 4, torch.device("cuda", 0),
            contains=("q_scale", "cuda:0", "cpu"))
    _raises(ValueError, checks.head_scale, torch.rand(8)[::2], "q_scale", 4, torch.device("cpu"),
            contains=("q_scale", "contiguous", "stride 2"))
    _raises(ValueError, checks.head_scale, -1.0, "v_scale", 4, torch.device("cpu"), contains=("v_scale", "positive"))


def test_scale_refuses_tensor_and_accepts_numbers():
    _raises(ValueError, checks.scale, torch.tensor(2.0), "k_scale", contains=("k_scale", "tensor scales", "fa3 fp8", "float"))
    assert checks.scale(None, "q_scale") is None
    assert checks.scale(2, "q_scale") == 2.0 and isinstance(checks.scale(2, "q_scale"), float)


def test_wrapper_refuses_a_cpu_workspace():
    from attnforge import BatchDecodeWithPagedKVCacheWrapper

    _raises(ValueError, BatchDecodeWithPagedKVCacheWrapper, torch.empty(1024, dtype=torch.uint8),
            contains=("float_workspace_buffer", "CUDA", "cpu"))
    _raises(TypeError, BatchDecodeWithPagedKVCacheWrapper, bytearray(16), contains=("float_workspace_buffer",))


# ---------------------------------------------------------------- dispatch


def test_to_dtype_accepts_torch_dtypes_and_names():
    assert dispatch.to_dtype(torch.bfloat16, "q_data_type") is DType.BF16
    assert dispatch.to_dtype("bf16", "q_data_type") is DType.BF16
    assert dispatch.to_dtype("float16", "q_data_type") is DType.FP16
    assert dispatch.to_dtype(None, "kv_data_type", allow_none=True) is None


def test_to_dtype_errors_name_the_argument():
    _raises(ValueError, dispatch.to_dtype, torch.float32, "q_data_type",
            contains=("q_data_type", "torch.float32", "not an attention dtype", "torch.bfloat16"))
    _raises(ValueError, dispatch.to_dtype, "int8", "kv_data_type", contains=("kv_data_type", "'int8'", "bf16"))
    _raises(TypeError, dispatch.to_dtype, 16, "o_data_type", contains=("o_data_type", "int", "16"))
    _raises(TypeError, dispatch.to_dtype, None, "q_data_type", contains=("q_data_type", "None"))


def test_parse_backend():
    assert dispatch.parse_backend("fa2") == "fa2"
    _raises(ValueError, dispatch.parse_backend, "fa4", contains=("backend", "'fa4'", "'auto'", "'fa2'", "'fa3'"))


def test_parse_pos_encoding():
    assert dispatch.parse_pos_encoding("none") is PosEncoding.NONE
    assert dispatch.parse_pos_encoding(PosEncoding.ALIBI) is PosEncoding.ALIBI
    _raises(ValueError, dispatch.parse_pos_encoding, "rope",
            contains=("pos_encoding_mode", "'rope'", "NONE", "ROPE_LLAMA", "ALIBI"))


def _decode_spec(**overrides):
    kwargs = dict(backend="auto", dtype_q=DType.BF16, dtype_kv=DType.BF16, dtype_o=DType.BF16, head_dim=128,
                  pos_encoding=PosEncoding.NONE, use_sliding_window=False, use_logits_soft_cap=False,
                  archs=(Arch.SM90A,))
    kwargs.update(overrides)
    return dispatch.decode_spec(**kwargs)


def _refused(rule_id: str, **overrides) -> UnsupportedSpecError:
    with pytest.raises(UnsupportedSpecError) as info:
        _decode_spec(**overrides)
    rule = RULES_BY_ID[rule_id]
    assert rule_id in info.value.rule_ids
    message = str(info.value)
    assert f"[{rule_id}]" in message
    assert rule.suggestion.format(s=info.value.spec) in message
    return info.value


def test_decode_spec_auto_is_fa2():
    assert _decode_spec().backend.value == "fa2"
    assert _decode_spec(backend="fa2", archs=(Arch.SM80,)).archs == (Arch.SM80,)


def test_decode_spec_refuses_fa3_with_rule_and_suggestion():
    error = _refused("decode-is-fa2", backend="fa3")
    assert "use_tensor_cores=True" in str(error)


def test_decode_spec_refuses_fp8_output():
    _refused("o-not-fp8", dtype_o=DType.E4M3)


def test_decode_spec_refuses_mixed_16bit_and_odd_head_dim():
    _refused("mixed-16bit-qkv", dtype_kv=DType.FP16)
    _refused("decode-head-dims", head_dim=144)



def test_decode_spec_takes_pos_encodings():
    for pos_encoding in (PosEncoding.ROPE_LLAMA, PosEncoding.ALIBI):
        assert _decode_spec(pos_encoding=pos_encoding).pos_encoding is pos_encoding


# ---------------------------------------------------------------------------------------
# plan() arguments both wrappers share


def test_heads_must_form_whole_groups():
    assert checks.heads(32, 8) == (32, 8)
    _raises(ValueError, checks.heads, 7, 2, contains=("num_qo_heads=7", "num_kv_heads=2"))
    _raises(ValueError, checks.heads, 0, 2, contains=("num_qo_heads", "expected an int in [1, 65535]", "got 0"))


@pytest.mark.parametrize("bad", [-2, True, 1.5, "3"])
def test_window_left_names_the_argument(bad):
    _raises(ValueError, checks.window_left, bad, contains=("window_left", "expected an int in [-1, 2147483647] (-1: no window", repr(bad)))


def test_window_left_accepts_none_marker_and_sizes():
    assert checks.window_left(-1) == -1 and checks.window_left(0) == 0 and checks.window_left(4096) == 4096


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_soft_cap_refuses_negative_and_non_finite(bad):
    _raises(ValueError, checks.soft_cap, bad, contains=("logits_soft_cap", repr(bad)))


def test_soft_cap_none_and_zero_mean_off():
    assert checks.soft_cap(None) == 0.0 and checks.soft_cap(0) == 0.0 and checks.soft_cap(30) == 30.0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "0.1"])
def test_positive_float_names_the_argument(bad):
    _raises(ValueError, checks.positive_float, bad, "rope_theta", 1e4, contains=("rope_theta", "positive float"))


def test_positive_float_default_for_none():
    assert checks.positive_float(None, "sm_scale", 0.125) == 0.125
    assert checks.positive_float(2, "rope_scale", 1.0) == 2.0


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_split_size_names_the_argument(bad):
    _raises(ValueError, checks.split_size, bad, contains=("fixed_split_size", "expected an int in [1, "))


def test_split_size_automatic_values():
    for ok in (None, -1, 1, 16):
        checks.split_size(ok)


# ---------------------------------------------------------------------------------------
# page ids (host tensors stand in for the device here)


def test_page_ids_must_be_a_1d_int32_tensor():
    from attnforge import kv_cache

    _raises(TypeError, kv_cache.check_page_ids, [1, 2], "indices", contains=("indices", "torch.Tensor"))
    _raises(ValueError, kv_cache.check_page_ids, torch.zeros(3, dtype=torch.int64), "indices",
            contains=("indices", "torch.int32", "torch.int64"))
    _raises(ValueError, kv_cache.check_page_ids, torch.zeros(3, 1, dtype=torch.int32), "paged_kv_indices",
            contains=("paged_kv_indices", "1-D", "(3, 1)"))


def test_host_page_ids_report_their_largest_used_id_and_refuse_negatives():
    from attnforge import kv_cache

    ids = torch.tensor([4, 9, 2, 100], dtype=torch.int32)  # the last id lies past indptr[-1] = 3
    staged, host_max = kv_cache.stage_page_ids(ids, 3, torch.device("cpu"), "indices")
    assert host_max == 9 and torch.equal(staged, ids)
    assert kv_cache.stage_page_ids(ids, 0, torch.device("cpu"), "indices")[1] == -1
    _raises(ValueError, kv_cache.stage_page_ids, torch.tensor([3, -1], dtype=torch.int32), 2, torch.device("cpu"),
            "paged_kv_indices", contains=("paged_kv_indices", ">= 0"))


def test_graph_page_ids_land_in_the_fixed_buffer():
    from attnforge import kv_cache

    buffer = torch.full((6,), -7, dtype=torch.int32)
    ids = torch.tensor([5, 1, 3], dtype=torch.int32)
    staged, host_max = kv_cache.stage_page_ids(ids, 3, torch.device("cpu"), "indices", buffer, "paged_kv_indices_buffer")
    assert staged is buffer and host_max == 5 and buffer[:3].tolist() == [5, 1, 3]
    _raises(ValueError, kv_cache.stage_page_ids, torch.zeros(8, dtype=torch.int32), 8, torch.device("cpu"), "indices",
            buffer, "paged_kv_indices_buffer", contains=("paged_kv_indices_buffer", "6 page ids", "needs 8"))


def test_run_extras_refuse_a_new_window():
    checks.run_extras(-1, None, None)
    checks.run_extras(64, False, 64)
    checks.run_extras(-1, True, None)  # PDL: on where the device has it
    _raises(ValueError, checks.run_extras, 64, None, 16, contains=("window_left", "64", "16", "plan again"))


def test_sinks_name_what_was_expected_and_given():
    cpu = torch.device("cpu")
    sinks = torch.zeros(4)
    assert checks.sinks(sinks, 4, cpu) is sinks
    _raises(TypeError, checks.sinks, [0.0] * 4, 4, cpu, contains=("sinks", "torch.Tensor", "list"))
    _raises(ValueError, checks.sinks, torch.zeros(4, dtype=torch.bfloat16), 4, cpu,
            contains=("sinks", "torch.float32", "torch.bfloat16"))
    _raises(ValueError, checks.sinks, torch.zeros(4), 4, torch.device("cuda", 0),
            contains=("sinks", "cuda:0", "cpu"))
    _raises(ValueError, checks.sinks, torch.zeros(8), 4, cpu, contains=("sinks", "(4,)", "[num_qo_heads]", "(8,)"))
    _raises(ValueError, checks.sinks, torch.zeros(1, 4), 4, cpu, contains=("sinks", "(4,)", "(1, 4)"))
    _raises(ValueError, checks.sinks, torch.zeros(8)[::2], 4, cpu, contains=("sinks", "contiguous", "(2,)"))


def test_accepted_sinks_checked_once_per_form():
    from attnforge.run_args import Accepted

    accepted, cpu = Accepted(), torch.device("cpu")
    assert accepted.sinks_ptr(None, 4, cpu) is None
    sinks = torch.zeros(5)[1:]  # any float32 address will do: the kernels read scalars
    assert accepted.sinks_ptr(sinks, 4, cpu) == sinks.data_ptr()
    other = torch.ones(4)
    assert accepted.sinks_ptr(other, 4, cpu) == other.data_ptr()
    _raises(ValueError, accepted.sinks_ptr, torch.zeros(3), 4, cpu, contains=("sinks", "(4,)", "(3,)"))
    _raises(ValueError, accepted.sinks_ptr, torch.zeros(4, dtype=torch.float16), 4, cpu, contains=("sinks", "float32"))


def test_accepted_forms_are_per_argument():
    """A form accepted for q is not accepted for out: an fp8 q beside a bf16 out plan, say, where an
    out shaped like q in q's dtype must still meet out's check (here: refused)."""
    from attnforge.run_args import Accepted

    accepted, seen = Accepted(), []
    q = torch.zeros(2, 4, 8)

    def refuse_out(x):
        seen.append("out")
        raise ValueError("out: expected dtype torch.bfloat16")

    accepted.ensure(q, "q", lambda x: seen.append("q"))
    accepted.ensure(q.clone(), "q", lambda x: seen.append("q again"))  # same form: no second check
    _raises(ValueError, accepted.ensure, torch.zeros(2, 4, 8), "out", refuse_out, contains=("out", "bfloat16"))
    assert seen == ["q", "out"]
    assert accepted.known(q, "q") and not accepted.known(q, "out")


def test_positional_scales_only_with_an_fp8_query():
    scales = (torch.ones(1), torch.ones(1), torch.ones(1))
    assert checks.positional_scales(scales, True, None, None, None) == scales
    assert checks.positional_scales((), False, 0.5, None, 2.0) == (0.5, None, 2.0)
    # A 16-bit query: FlashInfer ignores extra positional arguments; so do we, warning once per process.
    checks._warned_extra_args = False
    with pytest.warns(UserWarning, match="extra positional argument"):
        assert checks.positional_scales(scales, False, 0.5, None, None) == (0.5, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checks.positional_scales(scales, False, None, None, None) == (None, None, None)
    _raises(TypeError, checks.positional_scales, scales[:2], True, None, None, None,
            contains=("(q_scale, k_scale, v_scale)", "got 2"))
    _raises(TypeError, checks.positional_scales, scales, True, None, 1.0, None,
            contains=("both positionally and as keywords",))
