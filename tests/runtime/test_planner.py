"""The decode planner: properties of the Python oracle over drawn batches (CPU), and agreement
of the C++ planner inside a built module with the oracle, image for image and error for error."""

from __future__ import annotations

import ctypes
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnforge.codegen.abi import DECODE_PLAN_ARGS, DECODE_PLAN_INFO, PLAN_HEADER
from attnforge.codegen.dtypes import DType
from attnforge.codegen.kv_tiles import decode_kv_tile
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding
from attnforge.planner import (
    MAX_CTAS_PER_SM_BOUND,
    MIN_CHUNK_TOKENS,
    PlanError,
    PlanLayout,
    heads_per_cta,
    partial_bytes,
    plan_decode_oracle,
    work_capacity,
)

# ---------------------------------------------------------------- drawn batches


def _page_table(kv_lens: list[int], page_size: int, start: int) -> tuple[list[int], list[int]]:
    """(indptr, last_page_len) of requests with these kv lengths, page ids starting at `start`."""
    indptr, last = [start], []
    for kv in kv_lens:
        pages = -(-kv // page_size)
        indptr.append(indptr[-1] + pages)
        last.append(kv - (pages - 1) * page_size if pages else 0)
    return indptr, last


@st.composite
def batches(draw, max_batch: int = 300):
    page_size = draw(st.integers(1, 64))
    kv_len = st.one_of(st.just(0), st.integers(1, 300), st.integers(1, 20000))
    size = draw(st.one_of(st.integers(1, 8), st.integers(1, max_batch)))
    kv_lens = draw(st.lists(kv_len, min_size=size, max_size=size))
    start = draw(st.sampled_from([0, 0, 0, 7]))
    indptr, last = _page_table(kv_lens, page_size, start)
    fixed = draw(st.sampled_from([0, 0, 0, None]))
    return dict(
        kv_lens=kv_lens,
        indptr=indptr,
        last_page_len=last,
        page_size=page_size,
        num_indices=indptr[-1] + draw(st.sampled_from([0, 0, 3])),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 5000))),
        max_ctas=132 * draw(st.integers(1, 8)),
        ctas_per_request=draw(st.integers(1, 64)),
        fixed_split_tokens=draw(st.integers(16, 4096)) if fixed is None else 0,
        disable_split_kv=draw(st.booleans()),
        chunk_align_tokens=draw(st.sampled_from([1, 16, 32, 64, 128])),  # the decode kernels' kv tiles
    )


def capacity_for(b: dict) -> int:
    """The wrapper's rule (decode.py plan()): the automatic bound, widened for a fixed split."""
    batch = len(b["last_page_len"])
    capacity = work_capacity(batch, b["max_ctas"], b["ctas_per_request"])
    if b["fixed_split_tokens"]:
        capacity = max(capacity, batch + -(-b["indptr"][-1] * b["page_size"] // b["fixed_split_tokens"]))
    return capacity


ORACLE_KEYS = ("page_size", "num_indices", "ctas_per_request", "max_ctas", "window_left", "fixed_split_tokens",
               "disable_split_kv", "chunk_align_tokens")


def oracle(b: dict, layout: PlanLayout | None = None):
    layout = layout or PlanLayout(len(b["last_page_len"]), capacity_for(b), b["ctas_per_request"])
    return plan_decode_oracle(b["indptr"], b["last_page_len"], layout=layout, **{k: b[k] for k in ORACLE_KEYS}), layout


def work_items(image: list[int], layout: PlanLayout, num_work: int) -> list[tuple[int, int, int, int]]:
    return [(image[layout.offsets()["off_work_request"] + i], image[layout.offsets()["off_work_begin"] + i], image[layout.offsets()["off_work_end"] + i],
             image[layout.offsets()["off_work_partial"] + i]) for i in range(num_work)]


# ---------------------------------------------------------------- oracle properties


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_oracle_plan_tiles_every_request_once(b):
    result, layout = oracle(b)
    batch = len(b["last_page_len"])
    image = result.image
    assert len(image) == layout.size
    assert result.num_work <= layout.capacity
    assert image[PLAN_HEADER.index("num_work")] == result.num_work
    assert image[PLAN_HEADER.index("num_partials")] == result.num_partials
    assert image[layout.offsets()["off_indptr"] : layout.offsets()["off_indptr"] + batch + 1] == b["indptr"]

    items = work_items(image, layout, result.num_work)
    lengths = [end - begin for _, begin, end, _ in items]
    assert lengths == sorted(lengths, reverse=True), "work items must be ordered longest first"

    partial_indptr = image[layout.offsets()["off_partial_indptr"] : layout.offsets()["off_partial_indptr"] + batch + 1]
    assert partial_indptr[0] == 0 and partial_indptr[-1] == result.num_partials
    by_request: dict[int, list] = {r: [] for r in range(batch)}
    for request, begin, end, slot in items:
        assert 0 <= request < batch
        by_request[request].append((begin, end, slot))
    for r, kv in enumerate(b["kv_lens"]):
        own = sorted(by_request[r])
        assert own, f"request {r} has no work item"
        w = b["window_left"]
        lo = max(0, kv - 1 - w) if w >= 0 else 0
        # The items tile [lo, kv) exactly: consecutive, no gap, no overlap.
        assert own[0][0] == lo and own[-1][1] == kv
        for (_, end, _), (begin, _, _) in zip(own, own[1:]):
            assert end == begin
        assert all(begin <= end for begin, end, _ in own)
        if len(own) == 1:
            assert own[0][2] == -1 and partial_indptr[r + 1] == partial_indptr[r]
        else:
            assert all(begin < end for begin, end, _ in own), "a split request has no empty chunk"
            assert [slot for _, _, slot in own] == list(range(partial_indptr[r], partial_indptr[r + 1]))
    assert result.max_chunks == max(len(v) for v in by_request.values())

    automatic = not b["disable_split_kv"] and not b["fixed_split_tokens"]
    if automatic and batch * b["ctas_per_request"] < b["max_ctas"]:
        assert result.num_work * b["ctas_per_request"] <= b["max_ctas"]
        assert result.chunk_tokens >= MIN_CHUNK_TOKENS
        w = b["window_left"]
        spans = [kv - (max(0, kv - 1 - w) if w >= 0 else 0) for kv in b["kv_lens"]]
        assert_aligned_and_smallest(result.chunk_tokens, b["chunk_align_tokens"], b["max_ctas"] // b["ctas_per_request"],
                                    lambda chunk: sum(max(1, -(-n // chunk)) for n in spans), max(spans))
    elif b["fixed_split_tokens"] and not b["disable_split_kv"]:
        # Whatever the batch: a request's chunks (its reduction order) must not depend on its neighbours.
        assert result.chunk_tokens == b["fixed_split_tokens"], "fixed_split_size keeps its meaning: never aligned"
    if b["disable_split_kv"]:
        assert result.num_work == batch and result.num_partials == 0


def assert_aligned_and_smallest(chunk: int, align: int, slots: int, items_for, longest: int) -> None:
    """The automatic chunk (host/split_kv.h): s, the smallest chunk >= MIN_CHUNK_TOKENS whose items
    fit the slots (found here by bisection: item counts never grow with the chunk), rounded up to a
    multiple of `align` where that stays within the longest range and keeps >= 7/8 of s's items;
    else s itself."""
    assert items_for(chunk) <= slots, "the chunks must stay within the slots"
    lo, hi = MIN_CHUNK_TOKENS, max(chunk, MIN_CHUNK_TOKENS)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if items_for(mid) <= slots else (mid + 1, hi)
    aligned = -(-lo // align) * align
    keep = aligned <= longest and 8 * items_for(aligned) >= 7 * items_for(lo)
    assert chunk == (aligned if keep else lo), f"chunk {chunk}: expected {aligned if keep else lo} (search: {lo})"


def test_batch1_16k_gets_whole_tiles():
    """Issue 40's batch 1 x 16384 (bf16 hd 128, 8 kv heads, GQA 4: the 4-head tensor-core tile of
    64 tokens, 2 CTAs x 132 SMs): the search alone cuts 33 chunks of 497 tokens (7 full tiles and
    one of 49 rows, boundaries mid-page); aligned, 32 chunks of 512, page-aligned, 256 of 264 slots."""
    spec = KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))
    heads, tiles = heads_per_cta(4)
    assert (heads, tiles, decode_kv_tile(spec, heads)) == (4, 1, 64)
    b = dict(indptr=[0, 1024], last_page_len=[16], page_size=16, num_indices=1024, ctas_per_request=8, max_ctas=264,
             window_left=-1, fixed_split_tokens=0, disable_split_kv=False, kv_lens=[16384], chunk_align_tokens=1)
    unaligned, _ = oracle(b)
    assert (unaligned.max_chunks, unaligned.chunk_tokens) == (33, 497)
    result, layout = oracle({**b, "chunk_align_tokens": decode_kv_tile(spec, heads)})
    assert (result.max_chunks, result.chunk_tokens, result.num_work) == (32, 512, 32)
    assert sorted(begin for _, begin, _, _ in work_items(result.image, layout, result.num_work)) == list(
        range(0, 16384, 512))


@given(kv_len=st.integers(1, 300_000), page_size=st.sampled_from([1, 16, 64]), ctas_per_sm=st.integers(1, 8),
       ctas_per_request=st.integers(1, 64), align=st.sampled_from([1, 16, 32, 64, 128]))
def test_batch1_fills_the_slots(kv_len, page_size, ctas_per_sm, ctas_per_request, align):
    """Batch 1 splits its kv into enough chunks to occupy >= 3/4 of the slots its length can use
    (min(slots, ceil(kv / MIN_CHUNK_TOKENS))): the search fills them up to ceil rounding (< 1%
    once kv passes slots x MIN_CHUNK_TOKENS) and rounding to whole tiles gives up at most 1/8.
    Its partials fit the workspace decode_workspace_size sizes (132 SMs here)."""
    max_ctas = 132 * ctas_per_sm
    indptr, last = _page_table([kv_len], page_size, 0)
    b = dict(kv_lens=[kv_len], indptr=indptr, last_page_len=last, page_size=page_size, num_indices=indptr[-1],
             window_left=-1, max_ctas=max_ctas, ctas_per_request=ctas_per_request, fixed_split_tokens=0,
             disable_split_kv=False, chunk_align_tokens=align)
    result, _ = oracle(b)
    slots = max_ctas // ctas_per_request
    assert result.chunk_tokens >= MIN_CHUNK_TOKENS
    assert result.num_work == max(1, -(-kv_len // result.chunk_tokens))
    assert result.num_work * ctas_per_request <= max(max_ctas, ctas_per_request)
    if ctas_per_request < max_ctas:
        usable = min(slots, -(-kv_len // MIN_CHUNK_TOKENS))
        assert 4 * result.num_work >= 3 * usable, f"{result.num_work} items of {usable} usable slots"
    workspace_items = work_capacity(1, 132 * MAX_CTAS_PER_SM_BOUND, ctas_per_request)
    assert sum(partial_bytes(result.num_partials, 32, 128)) <= sum(partial_bytes(workspace_items, 32, 128))


def test_batch1_just_past_whole_tiles_keeps_its_slots():
    """1 x 4300 tokens on the tensor-core decode's 128-key tile (33 slots): the search's 131-token
    chunks give 33 items; whole tiles (256) would give 17, leaving half the SMs idle for no shorter
    item (both are two tiles deep), so the chunk stays 131. 4 x 1100 likewise keeps 32 items of 138
    tokens rather than 20 of 256. 1 x 4096 is whole tiles either way (32 x 128)."""
    base = dict(page_size=16, ctas_per_request=8, max_ctas=264, window_left=-1, fixed_split_tokens=0,
                disable_split_kv=False, chunk_align_tokens=128)
    for kv_lens, chunk, items in (([4300], 131, 33), ([1100] * 4, 138, 32), ([4096], 128, 32)):
        indptr, last = _page_table(kv_lens, 16, 0)
        result, _ = oracle(dict(base, kv_lens=kv_lens, indptr=indptr, last_page_len=last, num_indices=indptr[-1]))
        assert (result.chunk_tokens, result.num_work) == (chunk, items), kv_lens


def _bad_variants(b: dict, draw_index: int) -> list[tuple[dict, str]]:
    """Mutations of a valid batch that the planner must refuse, each with the argument (and index)
    its message must name."""
    batch = len(b["last_page_len"])
    out = []
    j = 1 + draw_index % batch
    indptr = list(b["indptr"])
    indptr[j] = indptr[j - 1] - 1 - draw_index % 3
    if j < batch or indptr[j] >= 0:
        out.append(({**b, "indptr": indptr}, f"indptr[{j}]"))
    non_empty = [r for r, kv in enumerate(b["kv_lens"]) if kv > 0]
    if non_empty:
        r = non_empty[draw_index % len(non_empty)]
        for value in (0, b["page_size"] + 1 + draw_index % 5):
            last = list(b["last_page_len"])
            last[r] = value
            out.append(({**b, "last_page_len": last}, f"last_page_len[{r}]"))
    if b["indptr"][-1] > 0:
        out.append(({**b, "num_indices": b["indptr"][-1] - 1}, "indptr[-1]"))
    r = draw_index % batch
    last = list(b["last_page_len"])
    last[r] = -1
    out.append(({**b, "last_page_len": last}, f"last_page_len[{r}]"))
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(max_batch=40), st.integers(0, 10**6))
def test_oracle_refuses_bad_page_tables_naming_the_index(b, draw_index):
    for bad, named in _bad_variants(b, draw_index):
        with pytest.raises(PlanError) as info:
            oracle(bad, PlanLayout(len(bad["last_page_len"]), capacity_for(b), b["ctas_per_request"]))
        assert named in str(info.value)


def test_fixed_split_cuts_a_request_alike_in_a_batch_that_fills_the_gpu():
    """FlashInfer's fixed_split_size applies whatever the batch (batch-invariant serving sets it so a
    request's chunks, so its reduction order, do not change with the batch around it): a 4096-token
    request gets the same chunk boundaries alone and among 64 requests whose unsplit work already
    fills the GPU (64 x 8 CTAs >= 264)."""
    def plan(batch: int):
        b = dict(indptr=[256 * r for r in range(batch + 1)], last_page_len=[16] * batch, page_size=16,
                 num_indices=256 * batch, ctas_per_request=8, max_ctas=264, window_left=-1, fixed_split_tokens=1024,
                 disable_split_kv=False, kv_lens=[4096] * batch, chunk_align_tokens=128)
        return oracle(b, PlanLayout(batch, batch * 4, 8))[0]

    alone, crowded = plan(1), plan(64)
    assert alone.chunk_tokens == crowded.chunk_tokens == 1024
    assert (alone.num_partials, crowded.num_partials) == (4, 64 * 4)


def test_oracle_refuses_a_negative_first_offset():
    b = dict(indptr=[-1, 2], last_page_len=[3], page_size=4, num_indices=8, ctas_per_request=1, max_ctas=132,
             window_left=-1, fixed_split_tokens=0, disable_split_kv=False, kv_lens=[3], chunk_align_tokens=1)
    with pytest.raises(PlanError, match=re.escape("indptr[0]")):
        oracle(b)


def test_oracle_refuses_a_plan_beyond_its_capacity():
    b = dict(indptr=[0, 100], last_page_len=[16], page_size=16, num_indices=100, ctas_per_request=1, max_ctas=132,
             window_left=-1, fixed_split_tokens=16, disable_split_kv=False, kv_lens=[1600], chunk_align_tokens=1)
    with pytest.raises(PlanError, match="work items"):
        oracle(b, PlanLayout(1, 10, 1))


def merge_counters(image: list[int], layout: PlanLayout) -> list[int]:
    start = layout.offsets()["off_merge_counters"]
    return image[start : start + layout.batch_size * layout.ctas_per_request]


def test_merge_counters_close_the_image_one_per_cta_unit_zeroed():
    """The fused merge's counters: [batch, ctas_per_request] int32 after every other array, the
    image's last entries, all 0 in a fresh plan (the decode kernel returns them to 0 after a run)."""
    b = dict(indptr=[0, 64, 64, 65], last_page_len=[16, 0, 3], page_size=16, num_indices=65, ctas_per_request=6,
             max_ctas=264, window_left=-1, fixed_split_tokens=0, disable_split_kv=False, kv_lens=[1024, 0, 3],
             chunk_align_tokens=1)
    result, layout = oracle(b)
    assert result.num_partials > 1, "request 0 must be split for the counters to matter"
    offsets = layout.offsets()
    ends = sorted((offset, name) for name, offset in offsets.items())
    assert ends[-1][1] == "off_merge_counters" and offsets["off_merge_counters"] == offsets["off_kv_len"] + 3
    assert layout.size == offsets["off_merge_counters"] + 3 * 6
    assert PlanLayout(3, layout.capacity, 1).size == layout.size - 3 * 5
    assert merge_counters(result.image, layout) == [0] * 18


@pytest.mark.nvcc
def test_cxx_planner_zeroes_merge_counters_a_previous_plan_left_dirty(module):
    """A pinned image is reused across plans: counters that hold garbage (a run cut short, a first
    upload of a never-written buffer) must be 0 after the next plan, which otherwise equals the oracle's."""
    b = dict(indptr=[0, 64, 66], last_page_len=[16, 5], page_size=16, num_indices=66, ctas_per_request=8,
             max_ctas=264, window_left=-1, fixed_split_tokens=0, disable_split_kv=False, kv_lens=[1024, 21],
             chunk_align_tokens=1)
    result, layout = oracle(b)
    image = (ctypes.c_int32 * layout.size)(*([-7] * layout.size))
    status, first, _, error = cxx_plan(module, b, layout, image)
    assert status == 0, error
    assert merge_counters(first, layout) == [0] * 16
    start = layout.offsets()["off_merge_counters"]
    for i in range(16):
        image[start + i] = 3 + i  # as if the kernel had counted arrivals and never reset them
    status, second, _, error = cxx_plan(module, b, layout, image)
    assert status == 0, error
    assert merge_counters(second, layout) == [0] * 16
    written = [i for i, v in enumerate(result.image) if v != 0] + list(range(start, layout.size))
    assert [second[i] for i in written] == [result.image[i] for i in written]


def test_empty_request_gets_one_empty_item():
    b = dict(indptr=[0, 0, 3], last_page_len=[0, 5], page_size=8, num_indices=3, ctas_per_request=2, max_ctas=132,
             window_left=-1, fixed_split_tokens=0, disable_split_kv=False, kv_lens=[0, 21], chunk_align_tokens=1)
    result, layout = oracle(b)
    items = work_items(result.image, layout, result.num_work)
    assert sorted(items) == [(0, 0, 0, -1), (1, 0, 21, -1)]


# ---------------------------------------------------------------- C++ planner == oracle

STRUCTS = (DECODE_PLAN_ARGS, DECODE_PLAN_INFO)


@pytest.fixture(scope="module")
def module(plan_shim):
    """host/decode_plan.h compiled into a test shim (conftest.plan_shim): the planner every decode
    module runs, without compiling its kernels."""
    return plan_shim("decode_plan.h", "plan_decode", *STRUCTS)


def cxx_plan(shim, b: dict, layout: PlanLayout, image=None):
    """Call the C++ planner as decode.py plan() does, on a zeroed image (entries it does not
    write stay 0, as in the oracle's image) or on `image`, a ctypes array reused across plans.
    (status, image, info, error message)"""
    indptr = (ctypes.c_int32 * len(b["indptr"]))(*b["indptr"])
    last_page_len = (ctypes.c_int32 * max(len(b["last_page_len"]), 1))(*b["last_page_len"])
    image = (ctypes.c_int32 * layout.size)() if image is None else image
    args = shim.mirrors["DecodePlanArgs"](
        indptr=ctypes.addressof(indptr), last_page_len=ctypes.addressof(last_page_len), image=ctypes.addressof(image),
        batch_size=len(b["last_page_len"]), min_chunk_tokens=MIN_CHUNK_TOKENS, work_capacity=layout.capacity,
        **{k: int(b[k]) for k in ORACLE_KEYS}, **layout.offsets())
    info = shim.mirrors["DecodePlanInfo"]()
    status = shim.shim_plan(ctypes.byref(args), ctypes.byref(info))
    return status, list(image), info, shim.shim_last_error().decode()


@pytest.mark.nvcc
def test_shim_struct_layouts_match_the_ctypes_mirrors(module):
    table = (ctypes.c_int64 * 256)()
    count = module.shim_abi(table, 256)
    expected = []
    for struct in STRUCTS:
        mirror = module.mirrors[struct.name]
        expected += [ctypes.sizeof(mirror), *(getattr(mirror, f.name).offset for f in struct.fields)]
    assert list(table[:count]) == expected


@pytest.mark.nvcc
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(b=batches())
def test_cxx_planner_matches_oracle(module, b):
    result, layout = oracle(b)
    status, image, info, error = cxx_plan(module, b, layout)
    assert status == 0, error
    assert image == result.image
    assert (info.num_work, info.num_partials, info.chunk_tokens, info.max_chunks) == (
        result.num_work, result.num_partials, result.chunk_tokens, result.max_chunks)


@pytest.mark.nvcc
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(b=batches(max_batch=40), draw_index=st.integers(0, 10**6))
def test_cxx_planner_refuses_what_the_oracle_refuses(module, b, draw_index):
    for bad, named in _bad_variants(b, draw_index):
        layout = PlanLayout(len(bad["last_page_len"]), capacity_for(b), b["ctas_per_request"])
        with pytest.raises(PlanError) as info:
            oracle(bad, layout)
        assert named in str(info.value)
        status, _, _, error = cxx_plan(module, bad, layout)
        assert status != 0
        assert named in error, (named, error)


@pytest.mark.nvcc
def test_cxx_planner_refuses_a_plan_beyond_its_capacity(module):
    b = dict(indptr=[0, 100], last_page_len=[16], page_size=16, num_indices=100, ctas_per_request=1, max_ctas=132,
             window_left=-1, fixed_split_tokens=16, disable_split_kv=False, kv_lens=[1600], chunk_align_tokens=1)
    status, _, _, error = cxx_plan(module, b, PlanLayout(1, 10, 1))
    assert status != 0
    assert "work items" in error and "fixed_split_size" in error


@pytest.mark.parametrize("pos_encoding", [PosEncoding.ROPE_LLAMA, PosEncoding.ALIBI])
def test_a_position_encoding_keeps_the_cuda_core_tile(pos_encoding):
    """The decode kernel rotates (RoPE) or biases (ALiBi) on the CUDA-core tile only: 4+ heads take the
    64-token MMA tile without a position encoding and the 8 KB CUDA-core tile (32 bf16 rows) with one."""
    spec = KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))
    assert decode_kv_tile(spec, 4) == 64
    assert decode_kv_tile(replace(spec, pos_encoding=pos_encoding), 4) == 8192 // (128 * 2)
