"""Integer arguments are range-checked at the boundary (issue 39, item 3), and the single_* helpers
and decode_workspace_size check their tensors and device before any CUDA work (item 6).

The kernels' structs hold sizes, counts and token positions in int32 fields: a value just past a
bound must raise a ValueError naming the argument and the range, the bound itself must pass. All
of it runs on the CPU: the checks read metadata and run before anything touches CUDA."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from attnforge import checks, kv_cache, page
from attnforge.decode import BatchDecodeWithPagedKVCacheWrapper, decode_workspace_size, single_decode_with_kv_cache
from attnforge.decode_inputs import DecodePlanInputs, check_knobs, check_q_len
from attnforge.prefill import single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse
from attnforge.prefill_plan_steps import check_bounds, check_options, check_request

INT32_MAX = 2**31 - 1


def _raises_range(fn, name: str, lo: int, hi: int, value) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    assert message.startswith(f"{name}: expected an int in [{lo}, {hi}] ("), message
    assert message.endswith(f"got {value!r}"), message
    return message


# ----------------------------------------------------------------------------- int_in
@given(lo=st.integers(-2**40, 2**40), width=st.integers(0, 2**33), offset=st.integers(-3, 3))
def test_int_in_accepts_exactly_the_closed_range(lo, width, offset):
    hi = lo + width
    for edge in (lo, hi):
        value = edge + offset
        if lo <= value <= hi:
            assert checks.int_in(value, "arg", lo, hi) == value
        else:
            _raises_range(lambda: checks.int_in(value, "arg", lo, hi), "arg", lo, hi, value)


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, 2**31])
def test_int_in_refuses_bools_floats_and_wrapping_ints(value):
    _raises_range(lambda: checks.int_in(value, "page_size", 0, INT32_MAX), "page_size", 0, INT32_MAX, value)


def test_the_issue_examples_are_refused():
    """window_left=2**32 used to become a window of 0 tokens, page_size=2**32+16 a page of 16,
    num_qo_heads=2**40 zero heads."""
    _raises_range(lambda: checks.window_left(2**32), "window_left", -1, INT32_MAX, 2**32)
    _raises_range(lambda: checks.positive_int(2**32 + 16, "page_size"), "page_size", 1, INT32_MAX, 2**32 + 16)
    _raises_range(lambda: checks.heads(2**40, 1), "num_qo_heads", 1, 65535, 2**40)


# ----------------------------------------------------------------------------- decode plan()
def _decode_inputs(**overrides) -> DecodePlanInputs:
    args = dict(indptr=None, indices=None, last_page_len=None, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                page_size=16, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
                kv_data_type=None, o_data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
                fixed_split_size=None, disable_split_kv=False)
    args.update(overrides)
    return DecodePlanInputs(**args)


# (argument, other overrides that keep the rest valid at the bound, lowest valid, highest valid)
DECODE_BOUNDS = [
    ("num_qo_heads", dict(num_kv_heads=1), 1, 65535),
    ("num_kv_heads", dict(num_qo_heads=65535), 1, 65535),
    ("head_dim", {}, 1, INT32_MAX),
    ("page_size", {}, 1, INT32_MAX),
    ("window_left", {}, -1, INT32_MAX),
    ("fixed_split_size", dict(page_size=1), 1, INT32_MAX),
]


@pytest.mark.parametrize("name, others, lo, hi", DECODE_BOUNDS, ids=[row[0] for row in DECODE_BOUNDS])
@given(past=st.integers(1, 2**40))
def test_decode_plan_bounds_each_integer(name, others, lo, hi, past):
    check_knobs(_decode_inputs(**others, **{name: hi}))
    check_knobs(_decode_inputs(**others, **{name: lo}))
    for bad in (hi + past, lo - past):
        if (name == "num_kv_heads" and bad > 0) or (name == "fixed_split_size" and bad == -1):
            continue  # above the bound it is also more than num_qo_heads; -1 is the automatic split
        _raises_range(lambda: check_knobs(_decode_inputs(**others, **{name: bad})), name, lo, hi, bad)


@pytest.mark.parametrize("page_size", [1, 16, 4096])
def test_decode_chunk_tokens_bound_fixed_split_size(page_size):
    """fixed_split_size pages of page_size tokens: the planner's int32 fixed_split_tokens."""
    top = INT32_MAX // page_size
    check_knobs(_decode_inputs(page_size=page_size, fixed_split_size=top))
    message = _raises_range(lambda: check_knobs(_decode_inputs(page_size=page_size, fixed_split_size=top + 1)),
                            "fixed_split_size", 1, top, top + 1)
    assert f"page_size={page_size}" in message


def test_q_len_per_req_is_int32():
    assert check_q_len(INT32_MAX, None, True) == INT32_MAX
    _raises_range(lambda: check_q_len(2**31, None, True), "q_len_per_req", 1, INT32_MAX, 2**31)


def _bare_decode_wrapper(tensor_cores: bool = False) -> BatchDecodeWithPagedKVCacheWrapper:
    """A decode wrapper with only the state plan() reads before it touches CUDA."""
    wrapper = object.__new__(BatchDecodeWithPagedKVCacheWrapper)
    wrapper._tensor_cores = object() if tensor_cores else None
    wrapper._knobs, wrapper._plan, wrapper._graph = None, None, False
    return wrapper


def test_decode_plan_bounds_each_requests_kv_tokens():
    """(pages - 1) * page_size + last_page_len is int32 in the planner: a request of 2 pages of
    2**30 tokens is refused before planning, naming page_size."""
    indptr = torch.tensor([0, 1, 3], dtype=torch.int32)
    inputs = _decode_inputs(indptr=indptr, indices=torch.arange(3, dtype=torch.int32),
                            last_page_len=torch.ones(2, dtype=torch.int32), page_size=2**30)
    message = _raises_range(lambda: _bare_decode_wrapper()._plan_from(inputs), "page_size", 1, INT32_MAX // 2, 2**30)
    assert "longest request's 2 pages" in message


def test_tensor_core_decode_bounds_the_batchs_query_tokens():
    inputs = dict(indptr=torch.tensor([0, 1, 2], dtype=torch.int32), q_len_per_req=2**30)
    wrapper = _bare_decode_wrapper(tensor_cores=True)
    _raises_range(lambda: wrapper._plan_tensor_cores(_decode_inputs(**inputs), None), "q_len_per_req", 1,
                  INT32_MAX // 2, 2**30)


# ----------------------------------------------------------------------------- prefill plan()
def _request(**overrides):
    args = dict(paged=True, qo_indptr=torch.tensor([0, 3, 5], dtype=torch.int32),
                kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32), indices=torch.arange(3, dtype=torch.int32),
                last_page_len=torch.tensor([4, 7], dtype=torch.int32), num_qo_heads=8, num_kv_heads=2, head_dim_qk=128,
                head_dim_vo=None, page_size=16)
    args.update(overrides)
    return check_request(**args)


def _options(**overrides):
    args = dict(head_dim_qk=128, custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
                rope_theta=None, q_data_type=torch.bfloat16, kv_data_type=None, o_data_type=None,
                fixed_split_size=None, disable_split_kv=False)
    args.update(overrides)
    return check_options(**args)


PREFILL_REQUEST_BOUNDS = [
    ("num_qo_heads", dict(num_kv_heads=1), 1, 65535),
    ("num_kv_heads", dict(num_qo_heads=65535), 1, 65535),
    ("head_dim_qk", {}, 1, INT32_MAX),
    ("head_dim_vo", {}, 1, INT32_MAX),
]


@pytest.mark.parametrize("name, others, lo, hi", PREFILL_REQUEST_BOUNDS, ids=[row[0] for row in PREFILL_REQUEST_BOUNDS])
def test_prefill_plan_bounds_each_integer(name, others, lo, hi):
    _request(**others, **{name: hi})
    bad = hi + 1
    if name != "num_kv_heads":  # above its bound num_kv_heads is also more than num_qo_heads
        _raises_range(lambda: _request(**others, **{name: bad}), name, lo, hi, bad)
    _raises_range(lambda: _request(**others, **{name: 2**32}), name, lo, hi, 2**32)


def test_prefill_page_size_bounded_by_the_longest_requests_pages():
    """Request 0 has 2 pages: its kv tokens, pages * page_size, must fit int32."""
    _request(page_size=INT32_MAX // 2, last_page_len=torch.tensor([4, 7], dtype=torch.int32))
    _raises_range(lambda: _request(page_size=INT32_MAX // 2 + 1), "page_size", 1, INT32_MAX // 2, INT32_MAX // 2 + 1)
    # a ragged request's page_size is 1 and its tokens come from an int32 indptr
    _request(paged=False, kv_indptr=torch.tensor([0, 5, 9], dtype=torch.int32), indices=None, last_page_len=None,
             page_size=1)
    _raises_range(lambda: _request(page_size=2**32 + 16), "page_size", 1, INT32_MAX, 2**32 + 16)


def test_prefill_packed_rows_bounded_by_the_longest_requests_queries():
    """Query rows times the GQA group are the kernels' packed rows (int32): with requests of 2**30
    and 1 queries, a group of 2 overflows, a group of 1 fits."""
    qo = torch.tensor([0, 2**30, 2**30 + 1], dtype=torch.int32)
    _request(qo_indptr=qo, num_qo_heads=2, num_kv_heads=2)
    message = _raises_range(lambda: _request(qo_indptr=qo, num_qo_heads=4, num_kv_heads=2),
                            "num_qo_heads / num_kv_heads", 1, INT32_MAX // 2**30, 2)
    assert "packed query rows" in message


def test_prefill_options_bound_window_and_split():
    _options(window_left=INT32_MAX, fixed_split_size=INT32_MAX)
    _raises_range(lambda: _options(window_left=2**32), "window_left", -1, INT32_MAX, 2**32)
    _raises_range(lambda: _options(fixed_split_size=2**31), "fixed_split_size", 1, INT32_MAX, 2**31)


def test_prefill_bounds_that_need_batch_and_options():
    """check_bounds: a chunk's kv tokens (fixed_split_size * page_size) and the window's edge, a
    query position (down to minus the longest request's queries, 3 here) minus window_left."""
    request = _request()
    check_bounds(request, _options(fixed_split_size=INT32_MAX // 16, window_left=INT32_MAX - 3))
    _raises_range(lambda: check_bounds(request, _options(fixed_split_size=INT32_MAX // 16 + 1)), "fixed_split_size", 1,
                  INT32_MAX // 16, INT32_MAX // 16 + 1)
    _raises_range(lambda: check_bounds(request, _options(window_left=INT32_MAX - 2)), "window_left", -1, INT32_MAX - 3,
                  INT32_MAX - 2)


# ----------------------------------------------------------------------------- tensors' sizes
def test_index_arrays_and_caches_bounded_by_their_int32_counts():
    """Sizes that end in int32 fields (num_indices, num_pages) are checked from metadata: expanded
    views have 2**31 entries without the memory."""
    ids = torch.zeros(1, dtype=torch.int32).expand(2**31)
    _raises_range(lambda: kv_cache.check_page_ids(ids, "paged_kv_indices"), "paged_kv_indices entries", 0, INT32_MAX,
                  2**31)
    kv_cache.check_page_ids(torch.zeros(1, dtype=torch.int32).expand(INT32_MAX), "paged_kv_indices")
    pages = torch.zeros(1, 16, 2, 128, dtype=torch.float16).expand(2**31, 16, 2, 128)
    _raises_range(lambda: kv_cache.split_paged((pages, pages), "NHD", 16, 2, 128, 128, torch.float16,
                                               torch.device("cpu")), "paged_kv_cache pages", 0, INT32_MAX, 2**31)


def test_plan_image_size_is_int32():
    assert checks.plan_image_size(INT32_MAX, 1) == INT32_MAX
    with pytest.raises(ValueError, match=re.escape(f"plan(): the plan image needs {2**31} int32 entries")):
        checks.plan_image_size(2**31, 5)


def test_page_helpers_bound_their_ints():
    indptr, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    page.get_seq_lens(indptr, last, INT32_MAX)
    _raises_range(lambda: page.get_seq_lens(indptr, last, 2**31), "page_size", 1, INT32_MAX, 2**31)
    _raises_range(lambda: page.get_batch_indices_positions(indptr, last, 2**31), "nnz", 0, INT32_MAX, 2**31)
    _raises_range(lambda: page.get_batch_indices_positions(indptr, last, True), "nnz", 0, INT32_MAX, True)


# ----------------------------------------------------------------------------- single_* and decode_workspace_size
def _qkv(q_dims: int, device: str = "cpu", kv_dtype=torch.float16):
    q = torch.empty((5, 4, 64)[3 - q_dims:], dtype=torch.float16, device=device)
    k = torch.empty(7, 2, 64, dtype=kv_dtype, device=device)
    return q, k, torch.empty(7, 2, 64, dtype=kv_dtype, device=device)


SINGLES = [(single_decode_with_kv_cache, 2), (single_prefill_with_kv_cache, 3),
           (single_prefill_with_kv_cache_return_lse, 3)]


@pytest.mark.parametrize("fn, q_dims", SINGLES, ids=["single_decode", "single_prefill", "single_prefill_return_lse"])
def test_single_helpers_name_a_cpu_q(fn, q_dims, monkeypatch):
    """A CPU q is named before any CUDA work (workspace sizing or allocation would fail in torch)."""
    import attnforge.decode as decode_module
    import attnforge.prefill as prefill_module

    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA work before the tensor checks")

    monkeypatch.setattr(decode_module, "decode_workspace_size", no_cuda)
    monkeypatch.setattr(decode_module, "BatchDecodeWithPagedKVCacheWrapper", no_cuda)
    monkeypatch.setattr(prefill_module, "BatchPrefillWithRaggedKVCacheWrapper", no_cuda)
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor .*got one on cpu"):
        fn(*_qkv(q_dims))


@pytest.mark.parametrize("fn, q_dims", SINGLES, ids=["single_decode", "single_prefill", "single_prefill_return_lse"])
def test_single_helpers_name_k_and_v(fn, q_dims):
    """With a CUDA q (a fake tensor: no GPU needed), k and v are checked against it by name."""
    cpu_k, cpu_v = _qkv(q_dims)[1:]
    with FakeTensorMode():  # fake CUDA tensors need no GPU; torch without CUDA can't view them, so each is new
        def cuda(*shape, dtype=torch.float16):
            return torch.empty(shape, dtype=dtype, device="cuda")

        q, k, v = _qkv(q_dims, "cuda")
        q_shape = q.shape
        cases = [
            ((q, cpu_k, v), r"^k: expected a tensor on q's device cuda:0, got one on cpu"),
            ((q, k, cpu_v), r"^v: expected a tensor on q's device cuda:0, got one on cpu"),
            ((q, k, cuda(7, 2, 64, dtype=torch.float8_e4m3fn)), r"^v: expected k's dtype torch.float16, got "
                                                                r"torch.float8_e4m3fn"),
            ((q, k, cuda(7, 1, 64)), r"^k, v: expected the same kv length and heads"),
            ((cuda(*q_shape[:-1], 32), k, v), r"^q: expected head dim 64 \(k's\)"),
            ((q, cuda(1, 7, 2, 64), v), r"^k: expected a 3-D tensor"),
            ((q, k, "v"), r"^v: expected a torch.Tensor, got str"),
            ((cuda(1, *q_shape), k, v), rf"^q: expected a {q_dims}-D tensor"),
        ]
    for args, text in cases:
        with pytest.raises((ValueError, TypeError), match=text):
            fn(*args)


def test_single_helpers_bound_the_kv_length():
    with FakeTensorMode():
        q = torch.empty(4, 64, dtype=torch.float16, device="cuda")
        k = torch.empty_strided((2**31, 2, 64), (0, 64, 1), dtype=torch.float16, device="cuda")
    _raises_range(lambda: single_decode_with_kv_cache(q, k, k), "k", 0, INT32_MAX, 2**31)


def test_decode_workspace_size_names_its_device():
    with pytest.raises(ValueError, match=r"^device: expected a CUDA device \(the kernels run there\), got cpu"):
        decode_workspace_size(4, 8, 2, 128, device="cpu")
    with pytest.raises(ValueError, match=r"^device: expected a CUDA device"):
        decode_workspace_size(4, 8, 2, 128, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device: None means the current CUDA device, but CUDA is not available"):
            decode_workspace_size(4, 8, 2, 128)


@pytest.mark.parametrize("args, name, lo, hi, value", [
    ((2**31, 8, 2, 128), "batch_size", 1, INT32_MAX, 2**31),
    ((4, 2**40, 2, 128), "num_qo_heads", 1, 65535, 2**40),
    ((4, 8, 0, 128), "num_kv_heads", 1, 65535, 0),
    ((4, 8, 2, 2**31), "head_dim", 1, INT32_MAX, 2**31),
    ((4, 8, 2, True), "head_dim", 1, INT32_MAX, True),
])
def test_decode_workspace_size_bounds_its_ints(args, name, lo, hi, value):
    _raises_range(lambda: decode_workspace_size(*args, device="cpu"), name, lo, hi, value)
