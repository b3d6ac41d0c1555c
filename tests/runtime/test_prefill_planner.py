"""The batch-prefill planner: properties of the Python oracle over drawn batches (CPU), and
agreement of the C++ planner (host/prefill_plan.h, compiled into a test shim) with the oracle,
image for image and error for error."""

from __future__ import annotations

import ctypes
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnforge.codegen.abi import PLAN_HEADER, PREFILL_PLAN_ARGS, PREFILL_PLAN_INFO
from attnforge.planner import MIN_CHUNK_TOKENS, PlanError
from attnforge.prefill_planner import (
    PrefillPlanLayout,
    cta_tile_q,
    packed_len_estimate,
    plan_prefill_oracle,
    prefill_partial_capacity,
    prefill_work_capacity,
)

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---------------------------------------------------------------- drawn batches


def _kv_indptr(kv_lens: list[int], page_size: int | None, start: int) -> tuple[list[int], list[int] | None]:
    """(kv_indptr, last_page_len) of requests with these kv lengths: pages from `start` when paged
    (page_size given), else tokens from `start` with no last_page_len."""
    indptr, last = [start], []
    for kv in kv_lens:
        extent = -(-kv // page_size) if page_size else kv
        indptr.append(indptr[-1] + extent)
        if page_size:
            last.append(kv - (extent - 1) * page_size if extent else 0)
    return indptr, (last if page_size else None)


@st.composite
def batches(draw, max_batch: int = 16, graph: bool | None = None):
    size = draw(st.one_of(st.integers(1, 4), st.integers(1, max_batch)))
    qo_lens = draw(st.lists(st.one_of(st.just(0), st.integers(1, 8), st.integers(1, 200)), min_size=size,
                            max_size=size))
    kv_lens = draw(st.lists(st.one_of(st.just(0), st.integers(1, 300), st.integers(1, 5000)), min_size=size,
                            max_size=size))
    page_size = draw(st.one_of(st.none(), st.integers(1, 64)))
    kv_indptr, last = _kv_indptr(kv_lens, page_size, draw(st.sampled_from([0, 0, 7])))
    qo_indptr = [0]
    for qo in qo_lens:
        qo_indptr.append(qo_indptr[-1] + qo)
    cuda_graph = draw(st.booleans()) if graph is None else graph
    fixed = draw(st.sampled_from([0, 0, 0, None]))
    return dict(
        qo_lens=qo_lens,
        kv_lens=kv_lens,
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        last_page_len=last,
        page_size=page_size or 1,
        num_indices=kv_indptr[-1] + draw(st.sampled_from([0, 0, 3])),
        num_kv_heads=draw(st.sampled_from([1, 2, 4, 8, 32])),
        group_size=draw(st.integers(1, 8)),
        max_cta_tile_q=draw(st.sampled_from([64, 128])),  # the module's tallest fa2 tile
        max_ctas=132 * draw(st.integers(1, 8)),
        causal=draw(st.booleans()),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 2000))),
        fixed_split_tokens=draw(st.integers(16, 2048)) if fixed is None else 0,
        disable_split_kv=draw(st.booleans()),
        chunk_align_tokens=draw(st.sampled_from([1, 64, 80, 128, 256])),  # the kernels' kv tiles
        cuda_graph=cuda_graph,
        fixed_cta_tile_q=draw(st.sampled_from([0, 0, 0, 128, 192])),
        row_capacity=qo_indptr[-1] + (draw(st.integers(0, 64)) if cuda_graph else 0),
    )


def tile_of(b: dict) -> int:
    if b.get("fixed_cta_tile_q"):
        return b["fixed_cta_tile_q"]
    rows = b["row_capacity"] if b["cuda_graph"] else b["qo_indptr"][-1]
    return cta_tile_q(packed_len_estimate(rows, len(b["qo_lens"]), b["group_size"], b["cuda_graph"]), b["max_cta_tile_q"])


def layout_for(b: dict) -> PrefillPlanLayout:
    """The wrapper's rule: the automatic bound from the (static under graphs) row count, widened
    for a fixed split by the most chunks any request can be cut into."""
    batch, tile = len(b["qo_lens"]), tile_of(b)
    capacity = prefill_work_capacity(b["row_capacity"], batch, b["group_size"], tile, b["max_ctas"], b["num_kv_heads"])
    if b["fixed_split_tokens"]:
        capacity *= max(1, -(-max(b["kv_lens"]) // b["fixed_split_tokens"]))
    return PrefillPlanLayout(batch, capacity, b["row_capacity"])


ORACLE_KEYS = ("page_size", "num_indices", "num_kv_heads", "group_size", "max_cta_tile_q", "max_ctas", "causal",
               "window_left", "fixed_split_tokens", "disable_split_kv", "chunk_align_tokens", "cuda_graph",
               "fixed_cta_tile_q")


def oracle(b: dict, layout: PrefillPlanLayout | None = None):
    layout = layout or layout_for(b)
    result = plan_prefill_oracle(b["qo_indptr"], b["kv_indptr"], b["last_page_len"], layout=layout,
                                 **{k: b[k] for k in ORACLE_KEYS})
    return result, layout


WORK_ARRAYS = ("work_request", "work_qo_tile", "work_kv_begin", "work_kv_end", "work_partial")


def array(image: list[int], layout: PrefillPlanLayout, name: str, length: int) -> list[int]:
    start = layout.offsets()[f"off_{name}"]
    return image[start : start + length]


def work_items(image: list[int], layout: PrefillPlanLayout, count: int) -> list[tuple[int, ...]]:
    return list(zip(*(array(image, layout, name, count) for name in WORK_ARRAYS)))


def visible(b: dict, r: int, t: int) -> tuple[int, int]:
    """The kv tokens [lo, hi) query token t of request r sees (the contract's semantics)."""
    qo, kv, w = b["qo_lens"][r], b["kv_lens"][r], b["window_left"]
    q_pos = t + kv - qo
    lo = max(0, q_pos - w) if w >= 0 else 0
    hi = min(kv, q_pos + 1) if b["causal"] else kv
    return lo, max(lo, hi)


def merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(i for i in intervals if i[0] < i[1]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [tuple(i) for i in out]


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


# ---------------------------------------------------------------- oracle properties


@SETTINGS
@given(batches())
def test_oracle_covers_every_visible_token_once_and_reads_nothing_masked(b):
    result, layout = oracle(b)
    batch, g, tile = len(b["qo_lens"]), b["group_size"], result.cta_tile_q
    image = result.image
    assert len(image) == layout.size and result.num_work <= layout.capacity
    assert tile == tile_of(b)
    assert image[PLAN_HEADER.index("num_work")] == result.num_work
    assert image[PLAN_HEADER.index("num_partials")] == result.num_partials
    assert array(image, layout, "qo_indptr", batch + 1) == b["qo_indptr"]
    assert array(image, layout, "kv_indptr", batch + 1) == b["kv_indptr"]
    assert array(image, layout, "kv_len", batch) == b["kv_lens"]
    num_chunks = array(image, layout, "num_chunks", batch)
    merge = array(image, layout, "merge_indptr", layout.row_capacity + 1)

    items = work_items(image, layout, result.num_work)
    lengths = [end - begin for _, _, begin, end, _ in items]
    assert lengths == sorted(lengths, reverse=True), "work items must be ordered longest first"
    by_tile: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r, qo_tile, begin, end, partial in items:
        by_tile.setdefault((r, qo_tile), []).append((begin, end, partial))
    expected_tiles = {(r, i) for r in range(batch) for i in range(-(-b["qo_lens"][r] * g // tile))}
    assert set(by_tile) == expected_tiles, "every q tile of every request, and nothing else"

    for (r, qo_tile), own in by_tile.items():
        chunks = num_chunks[r]
        base = merge[b["qo_indptr"][r]]
        # One item per chunk, its partial slot base + c (or -1 for an unsplit request).
        partials = sorted(partial for _, _, partial in own)
        assert partials == ([-1] if chunks == 1 else list(range(base, base + chunks)))
        # Each item reads inside its own chunk, and the tile's items never overlap.
        kv_lo = max(0, b["kv_lens"][r] - b["qo_lens"][r] - b["window_left"]) if b["window_left"] >= 0 else 0
        for begin, end, partial in own:
            c = 0 if partial == -1 else partial - base
            assert begin == end or kv_lo + c * result.chunk_tokens <= begin < end <= kv_lo + (c + 1) * result.chunk_tokens
        spans = sorted((begin, end) for begin, end, _ in own if begin < end)
        assert all(a[1] <= z[0] for a, z in zip(spans, spans[1:])), f"overlapping items in tile {(r, qo_tile)}"
        # Every token a row sees is read exactly once (spans are disjoint, so lengths add up) ...
        first_row = qo_tile * tile
        tokens = range(first_row // g, (min(b["qo_lens"][r] * g, first_row + tile) - 1) // g + 1)
        seen = [visible(b, r, t) for t in tokens]
        for lo, hi in seen:
            assert sum(max(0, min(hi, end) - max(lo, begin)) for begin, end in spans) == hi - lo
        # ... and no item reads a token that every row of its tile masks out.
        union = merged(seen)
        for begin, end in spans:
            assert any(lo <= begin and end <= hi for lo, hi in union), (r, qo_tile, begin, end, union)

    # merge_indptr: each row owns its request's num_chunks consecutive slots (none if unsplit),
    # padding rows own none, and the work items write every (slot, head in group) exactly once.
    assert merge[0] == 0
    for r in range(batch):
        step = num_chunks[r] if num_chunks[r] > 1 else 0
        for t in range(b["qo_lens"][r]):
            row = b["qo_indptr"][r] + t
            assert merge[row + 1] - merge[row] == step
            assert merge[row] == merge[b["qo_indptr"][r]] + t * step
    assert merge[b["qo_indptr"][-1] :] == [result.num_partials] * (layout.row_capacity - b["qo_indptr"][-1] + 1)
    written = Counter()
    for r, qo_tile, _, _, partial in items:
        if partial >= 0:
            for p in range(qo_tile * tile, min(b["qo_lens"][r] * g, (qo_tile + 1) * tile)):
                written[partial + (p // g) * num_chunks[r], p % g] += 1
    assert written == Counter({(slot, h): 1 for slot in range(result.num_partials) for h in range(g)})
    assert result.num_partials <= prefill_partial_capacity(layout.capacity, tile, g)

    # Padding past num_work is zero: the kernel's CTAs there exit on plan[num_work].
    for name in WORK_ARRAYS:
        assert array(image, layout, name, layout.capacity)[result.num_work :] == [0] * (layout.capacity - result.num_work)

    assert result.max_chunks == max(num_chunks)
    automatic = not b["disable_split_kv"] and not b["fixed_split_tokens"]
    if automatic and len(expected_tiles) * b["num_kv_heads"] < b["max_ctas"]:
        assert result.num_work * b["num_kv_heads"] <= b["max_ctas"]
        assert result.chunk_tokens >= MIN_CHUNK_TOKENS

        def items_for(chunk: int) -> int:
            tiles = [-(-qo * g // tile) for qo in b["qo_lens"]]
            spans = [kv - (max(0, kv - qo - b["window_left"]) if b["window_left"] >= 0 else 0)
                     for qo, kv in zip(b["qo_lens"], b["kv_lens"])]
            return sum(t * max(1, -(-n // chunk)) for t, n in zip(tiles, spans))

        longest = max(kv - (max(0, kv - qo - b["window_left"]) if b["window_left"] >= 0 else 0)
                      for qo, kv in zip(b["qo_lens"], b["kv_lens"]))
        assert_aligned_and_smallest(result.chunk_tokens, b["chunk_align_tokens"], b["max_ctas"] // b["num_kv_heads"],
                                    items_for, longest)
    elif b["fixed_split_tokens"] and not b["disable_split_kv"]:
        # Whatever the batch, as FlashInfer's planner: a request's chunks must not depend on its neighbours.
        assert result.chunk_tokens == b["fixed_split_tokens"], "fixed_split_size keeps its meaning: never aligned"
    if b["disable_split_kv"]:
        assert num_chunks == [1] * batch and result.num_partials == 0
    expected_empty_rows = sum(max(0, qo - kv) for qo, kv in zip(b["qo_lens"], b["kv_lens"])) if b["causal"] else 0
    assert result.causal_rows_without_keys == expected_empty_rows


@st.composite
def graph_pairs(draw):
    """Two batches sharing every static quantity of a CUDA-graph wrapper (batch size, row
    capacity, heads, head dim, GPU size, masking), differing in their lengths."""
    first = draw(batches(graph=True))
    second = draw(batches(graph=True))
    batch = len(first["qo_lens"])
    second_qo = draw(st.lists(st.integers(0, 200), min_size=batch, max_size=batch))
    second_kv = draw(st.lists(st.integers(0, 5000), min_size=batch, max_size=batch))
    kv_indptr, last = _kv_indptr(second_kv, first["page_size"] if first["last_page_len"] else None, 0)
    qo_indptr = [0]
    for qo in second_qo:
        qo_indptr.append(qo_indptr[-1] + qo)
    rows = max(first["qo_indptr"][-1], qo_indptr[-1]) + draw(st.integers(0, 64))
    static = {k: first[k] for k in ("num_kv_heads", "group_size", "max_cta_tile_q", "max_ctas", "causal", "window_left",
                                    "disable_split_kv", "page_size", "fixed_cta_tile_q",
                                    "chunk_align_tokens")}
    second = {**second, **static, "qo_lens": second_qo, "kv_lens": second_kv, "qo_indptr": qo_indptr,
              "kv_indptr": kv_indptr, "last_page_len": last, "num_indices": kv_indptr[-1]}
    return [{**one, "row_capacity": rows, "fixed_split_tokens": 0} for one in (first, second)]


@SETTINGS
@given(graph_pairs())
def test_graph_plans_fit_a_layout_from_static_inputs_only(pair):
    """Under CUDA graphs every offset, the grid and the kernel variant are fixed at capture: the
    layout from static inputs must hold any batch within the row capacity, with the same tile."""
    layouts = {layout_for(b) for b in pair}
    assert len(layouts) == 1
    results = [oracle(b)[0] for b in pair]
    assert results[0].cta_tile_q == results[1].cta_tile_q == tile_of(pair[0])


def _bad_variants(b: dict, draw_index: int) -> list[tuple[dict, str]]:
    """Mutations of a valid batch the planner must refuse, each with the argument (and index) its
    message must name."""
    batch = len(b["qo_lens"])
    j = 1 + draw_index % batch
    out = [({**b, "qo_indptr": [1 + draw_index % 3, *b["qo_indptr"][1:]]}, "qo_indptr[0]"),
           ({**b, "kv_indptr": [-1 - draw_index % 3, *b["kv_indptr"][1:]]}, "kv_indptr[0]"),
           ({**b, "row_capacity": b["qo_indptr"][-1] - 1}, "qo_indptr[-1]") if b["qo_indptr"][-1] else None,
           ({**b, "num_indices": b["kv_indptr"][-1] - 1}, "kv_indptr[-1]") if b["kv_indptr"][-1] else None]
    for name in ("qo_indptr", "kv_indptr"):
        indptr = list(b[name])
        indptr[j] = indptr[j - 1] - 1 - draw_index % 3
        out.append(({**b, name: indptr}, f"{name}[{j}]"))
    if b["last_page_len"] is not None:
        r = draw_index % batch
        pages = b["kv_indptr"][r + 1] - b["kv_indptr"][r]
        low = 1 if pages else 0  # a request without pages may say 0
        for value in (low - 1, b["page_size"] + 1 + draw_index % 5):
            last = list(b["last_page_len"])
            last[r] = value
            out.append(({**b, "last_page_len": last}, f"last_page_len[{r}]"))
    return [variant for variant in out if variant is not None]


def _layout_of_bad(bad: dict, good: dict) -> PrefillPlanLayout:
    """The good batch's layout, with the bad batch's row capacity (a refused total names it)."""
    layout = layout_for(good)
    return PrefillPlanLayout(layout.batch_size, layout.capacity, bad["row_capacity"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(), st.integers(0, 10**6))
def test_oracle_refuses_bad_host_arrays_naming_the_argument(b, draw_index):
    for bad, named in _bad_variants(b, draw_index):
        with pytest.raises(PlanError) as info:
            oracle(bad, _layout_of_bad(bad, b))
        assert named in str(info.value)


CAPACITY_CASE = dict(qo_lens=[512], kv_lens=[4096], qo_indptr=[0, 512], kv_indptr=[0, 4096], last_page_len=None,
                     page_size=1, num_indices=4096, num_kv_heads=1, group_size=1, max_cta_tile_q=128, max_ctas=132,
                     causal=False, window_left=-1, fixed_split_tokens=64, disable_split_kv=False, chunk_align_tokens=1,
                     cuda_graph=False,
                     fixed_cta_tile_q=0,
                     row_capacity=512)


def test_oracle_refuses_a_plan_beyond_its_capacity():
    with pytest.raises(PlanError, match="work items.*fixed_split_size"):
        oracle(CAPACITY_CASE, PrefillPlanLayout(1, 10, 512))


def test_causal_prompt_longer_than_its_kv_keeps_empty_tiles():
    """qo_len > kv_len with causal: the first rows see nothing (FlashInfer accepts it); their
    tile still gets an item, empty, so it writes o = 0 and lse = -inf."""
    b = dict(CAPACITY_CASE, qo_lens=[200], kv_lens=[10], qo_indptr=[0, 200], kv_indptr=[0, 10], num_indices=10,
             fixed_split_tokens=0, causal=True, row_capacity=200)
    result, layout = oracle(b)
    assert result.cta_tile_q == 128 and result.causal_rows_without_keys == 190
    assert sorted(work_items(result.image, layout, result.num_work)) == [(0, 0, 0, 0, -1), (0, 1, 0, 10, -1)]


def test_causal_split_gives_early_tiles_empty_chunks():
    """Chunks are cut from the request's whole range, so a causal q tile that ends before a chunk
    begins gets an empty item for it: every row keeps its request's chunk count."""
    b = dict(CAPACITY_CASE, qo_lens=[256], kv_lens=[256], qo_indptr=[0, 256], kv_indptr=[0, 256], num_indices=256,
             fixed_split_tokens=128, causal=True, row_capacity=256)
    result, layout = oracle(b)
    assert sorted(work_items(result.image, layout, result.num_work)) == [
        (0, 0, 0, 128, 0), (0, 0, 128, 128, 1), (0, 1, 0, 128, 0), (0, 1, 128, 256, 1)]


def test_tensor_core_decode_batch1_16k_gets_whole_tiles():
    """Issue 40's tensor-core decode case: 1 x 16384 tokens, bf16 hd 128, 8 kv heads, GQA 4, page
    16, 132 SMs x 2 CTAs. The search alone gives 33 chunks of 497 tokens (4 tiles of 128, the last
    113 rows, boundaries mid-page); aligned to the fa2 q16 variant's 128-key tile, 32 chunks of 512
    (FlashInfer's 32 pages), which still fill 256 of the 264 slots."""
    from attnforge.codegen.dtypes import DType
    from attnforge.codegen.kv_tiles import prefill_kv_tile
    from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind

    spec = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))
    b = dict(CAPACITY_CASE, qo_lens=[1], kv_lens=[16384], qo_indptr=[0, 1], kv_indptr=[0, 1024], last_page_len=[16],
             page_size=16, num_indices=1024, num_kv_heads=8, group_size=4, max_ctas=264, fixed_split_tokens=0,
             row_capacity=1)
    assert tile_of(b) == 16 and prefill_kv_tile(spec, 16, True) == 128
    unaligned, _ = oracle(b)
    assert (unaligned.max_chunks, unaligned.chunk_tokens) == (33, 497)
    result, layout = oracle({**b, "chunk_align_tokens": prefill_kv_tile(spec, 16, True)})
    assert (result.max_chunks, result.chunk_tokens, result.num_work) == (32, 512, 32)
    assert sorted(begin for _, _, begin, _, _ in work_items(result.image, layout, result.num_work)) == list(
        range(0, 16384, 512))


def test_tensor_core_decode_batch1_past_whole_tiles_keeps_its_slots():
    """1 x 4300 tokens, same shape as above: 131-token chunks fill 33 of the 33 slots; whole tiles
    (256) would fill 17 at the same two tiles per item, so alignment gives way (split_kv.h)."""
    b = dict(CAPACITY_CASE, qo_lens=[1], kv_lens=[4300], qo_indptr=[0, 1], kv_indptr=[0, 269], last_page_len=[12],
             page_size=16, num_indices=269, num_kv_heads=8, group_size=4, max_ctas=264, fixed_split_tokens=0,
             row_capacity=1, chunk_align_tokens=128)
    result, _ = oracle(b)
    assert (result.chunk_tokens, result.num_work) == (131, 33)


# ---------------------------------------------------------------- C++ planner == oracle

STRUCTS = (PREFILL_PLAN_ARGS, PREFILL_PLAN_INFO)


@pytest.fixture(scope="module")
def shim(plan_shim):
    """host/prefill_plan.h compiled into a test shim (conftest.plan_shim)."""
    return plan_shim("prefill_plan.h", "plan_prefill", *STRUCTS)


def int32_array(values: list[int]):
    return (ctypes.c_int32 * max(len(values), 1))(*values)


def cxx_plan(shim, b: dict, layout: PrefillPlanLayout):
    """Call the C++ planner as a wrapper's plan() would, on an image full of garbage (so every
    slot the oracle defines must be written). (status, image, info, error message)."""
    qo_indptr, kv_indptr = int32_array(b["qo_indptr"]), int32_array(b["kv_indptr"])
    last = int32_array(b["last_page_len"]) if b["last_page_len"] is not None else None
    image = int32_array([-12345] * layout.size)
    args = shim.mirrors["PrefillPlanArgs"](
        qo_indptr=ctypes.addressof(qo_indptr), kv_indptr=ctypes.addressof(kv_indptr),
        last_page_len=ctypes.addressof(last) if last is not None else None, image=ctypes.addressof(image),
        batch_size=len(b["qo_lens"]), paged=int(last is not None), min_chunk_tokens=MIN_CHUNK_TOKENS,
        work_capacity=layout.capacity, row_capacity=layout.row_capacity,
        **{k: int(b[k]) for k in ORACLE_KEYS}, **layout.offsets())
    info = shim.mirrors["PrefillPlanInfo"]()
    status = shim.shim_plan(ctypes.byref(args), ctypes.byref(info))
    return status, list(image), info, shim.shim_last_error().decode()


@pytest.mark.nvcc
def test_shim_struct_layouts_match_the_ctypes_mirrors(shim):
    table = (ctypes.c_int64 * 256)()
    count = shim.shim_abi(table, 256)
    expected = []
    for struct in STRUCTS:
        mirror = shim.mirrors[struct.name]
        expected += [ctypes.sizeof(mirror), *(getattr(mirror, f.name).offset for f in struct.fields)]
    assert list(table[:count]) == expected


@pytest.mark.nvcc
@SETTINGS
@given(b=batches())
def test_cxx_planner_matches_oracle(shim, b):
    result, layout = oracle(b)
    status, image, info, error = cxx_plan(shim, b, layout)
    assert status == 0, error
    assert image == result.image
    assert {f.name: getattr(info, f.name) for f in PREFILL_PLAN_INFO.fields} == {
        f.name: getattr(result, f.name) for f in PREFILL_PLAN_INFO.fields}


@pytest.mark.nvcc
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(b=batches(), draw_index=st.integers(0, 10**6))
def test_cxx_planner_refuses_what_the_oracle_refuses(shim, b, draw_index):
    for bad, named in [*_bad_variants(b, draw_index), ({**b, "qo_indptr": [0], "qo_lens": []}, "batch_size")]:
        layout = _layout_of_bad(bad, b)
        with pytest.raises(PlanError) as info:
            oracle(bad, layout)
        assert named in str(info.value)
        status, _, _, error = cxx_plan(shim, bad, layout)
        assert status != 0 and named in error, (named, error)
        assert error == str(info.value), "the two planners must say the same thing"


@pytest.mark.nvcc
def test_cxx_planner_refuses_a_plan_beyond_its_capacity(shim):
    status, _, _, error = cxx_plan(shim, CAPACITY_CASE, PrefillPlanLayout(1, 10, 512))
    assert status != 0 and "work items" in error and "fixed_split_size" in error
