"""Batch-prefill planning: the plan-image layout, sizing helpers and the pure-Python planner.

plan() runs the C++ planner inside each module (host/prefill_plan.h, whose header comment states
the contract). `plan_prefill_oracle` implements the same contract line for line; property tests
check that the two agree and that the plan covers every visible (row, kv token) exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnforge.codegen.abi import PLAN_HEADER
from attnforge.planner import MIN_CHUNK_TOKENS, ImageLayout, PlanError, split_chunk_tokens

__all__ = [
    "PrefillPlanLayout",
    "PrefillPlanResult",
    "cta_tile_q",
    "packed_len_estimate",
    "plan_prefill_oracle",
    "prefill_partial_capacity",
    "prefill_work_capacity",
    "tile_kv_range",
]


def cta_tile_q(avg_packed_len: int, max_cta_tile_q: int) -> int:
    """Packed q rows per CTA: tall tiles amortize each kv load over more
    rows, but on short prompts they would run mostly empty. max_cta_tile_q: the module's tallest fa2
    tile (codegen.kv_tiles.prefill_cta_tiles)."""
    if avg_packed_len > 64 and max_cta_tile_q >= 128:
        return 128
    return 64 if avg_packed_len > 16 else 16


def packed_len_estimate(total_rows: int, batch_size: int, group_size: int, cuda_graph: bool) -> int:
    """The packed length cta_tile_q is chosen from: the batch's average, or under CUDA graphs the
    longest request the static row capacity allows, so a captured graph keeps its variant.
    total_rows: this batch's query rows, or under CUDA graphs the static row capacity."""
    if cuda_graph:
        return (total_rows - batch_size + 1) * group_size
    return total_rows * group_size // batch_size


def prefill_work_capacity(total_rows: int, batch_size: int, group_size: int, tile: int, max_ctas: int,
                          num_kv_heads: int) -> int:
    """Most work items the automatic planner can emit: every q tile once (at most one partial tile
    per request beyond the rows' own), or, when it splits, max_ctas // num_kv_heads (its binary
    search guarantees that). A fixed split size may need more; the planner then refuses."""
    tiles = -(-total_rows * group_size // tile) + batch_size - 1
    return max(tiles, max_ctas // num_kv_heads, 1)


def prefill_partial_capacity(work_capacity: int, tile: int, group_size: int) -> int:
    """Most partial slots a plan within work_capacity can use: a split request's slots are its
    tokens times its chunks, and its q tiles x chunks work items hold at least tile / g tokens
    each."""
    return work_capacity * tile // group_size


@dataclass(frozen=True)
class PrefillPlanLayout(ImageLayout):
    """The prefill plan image: the header; qo_indptr and kv_indptr [batch+1]; kv_len and num_chunks
    [batch]; five work arrays of `capacity` entries (request, q tile, kv begin, kv end, partial
    slot); merge_indptr [row_capacity+1]."""

    batch_size: int
    capacity: int
    row_capacity: int

    def _arrays(self) -> tuple[tuple[str, int], ...]:
        batch, capacity = self.batch_size, self.capacity
        return (("qo_indptr", batch + 1), ("kv_indptr", batch + 1), ("kv_len", batch), ("num_chunks", batch),
                ("work_request", capacity), ("work_qo_tile", capacity), ("work_kv_begin", capacity),
                ("work_kv_end", capacity), ("work_partial", capacity), ("merge_indptr", self.row_capacity + 1))


@dataclass(frozen=True)
class PrefillPlanResult:
    image: list[int]
    num_work: int
    num_partials: int
    cta_tile_q: int
    chunk_tokens: int
    max_chunks: int
    causal_rows_without_keys: int


def tile_kv_range(qo_len: int, kv_len: int, tile: int, tile_rows: int, group_size: int, causal: bool,
                  window_left: int) -> tuple[int, int]:
    """The kv tokens some row of q tile `tile` sees: the window cuts at the first row's edge (rows
    further down see further right), causal cuts just past the last row's position."""
    shift = kv_len - qo_len
    first = tile * tile_rows // group_size
    last = (min(qo_len * group_size, (tile + 1) * tile_rows) - 1) // group_size
    begin = max(0, first + shift - window_left) if window_left >= 0 else 0
    end = min(max(last + shift + 1, 0), kv_len) if causal else kv_len
    return begin, end


def _check_indptr(indptr: list[int], name: str, start_at_zero: bool, limit: int, room: str) -> None:
    batch = len(indptr) - 1
    if (indptr[0] != 0) if start_at_zero else (indptr[0] < 0):
        raise PlanError(f"{name}[0] = {indptr[0]}: {name} must start at {'0' if start_at_zero else '>= 0'}")
    for r in range(batch):
        if indptr[r + 1] < indptr[r]:
            raise PlanError(f"{name}[{r + 1}] = {indptr[r + 1]} < {name}[{r}] = {indptr[r]}: "
                            f"{name} must be non-decreasing")
    if indptr[batch] > limit:
        raise PlanError(f"{name}[-1] = {indptr[batch]} but {room}")


def plan_prefill_oracle(
    qo_indptr: list[int],
    kv_indptr: list[int],
    last_page_len: list[int] | None,
    *,
    page_size: int,
    num_indices: int,
    num_kv_heads: int,
    group_size: int,
    max_cta_tile_q: int,
    max_ctas: int,
    causal: bool,
    window_left: int = -1,
    fixed_split_tokens: int = 0,
    disable_split_kv: bool = False,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
    chunk_align_tokens: int = 1,
    cuda_graph: bool = False,
    fixed_cta_tile_q: int = 0,
    layout: PrefillPlanLayout,
) -> PrefillPlanResult:
    """Reference implementation of host/prefill_plan.h (see its contract). last_page_len None
    means ragged kv: kv_indptr then counts tokens."""
    batch = len(qo_indptr) - 1
    paged = last_page_len is not None
    g = group_size
    if batch < 1:
        raise PlanError(f"batch_size = {batch}: expected at least one request")
    _check_indptr(qo_indptr, "qo_indptr", True, layout.row_capacity,
                  f"the plan has room for row_capacity={layout.row_capacity} query rows")
    _check_indptr(kv_indptr, "kv_indptr", False, num_indices,
                  f"indices holds only {num_indices} page ids" if paged else f"k and v hold only {num_indices} tokens")

    total_rows = qo_indptr[batch]
    estimate = packed_len_estimate(layout.row_capacity if cuda_graph else total_rows, batch, g, cuda_graph)
    tile_rows = fixed_cta_tile_q if fixed_cta_tile_q > 0 else cta_tile_q(estimate, max_cta_tile_q)

    qo_lens, kv_lens, kv_los, tiles = [], [], [], []
    rows_without_keys = 0
    for r in range(batch):
        extent = kv_indptr[r + 1] - kv_indptr[r]
        kv_len = extent
        if paged:
            low = 1 if extent > 0 else 0
            if not low <= last_page_len[r] <= page_size:
                raise PlanError(f"last_page_len[{r}] = {last_page_len[r]}, expected a value in [{low}, "
                                f"page_size={page_size}]" + ("" if extent > 0 else " (the request has no pages)"))
            kv_len = (extent - 1) * page_size + last_page_len[r] if extent > 0 else 0
        qo_len = qo_indptr[r + 1] - qo_indptr[r]
        qo_lens.append(qo_len)
        kv_lens.append(kv_len)
        kv_los.append(max(0, kv_len - qo_len - window_left) if window_left >= 0 else 0)
        tiles.append(-(-qo_len * g // tile_rows))
        if causal:
            rows_without_keys += max(0, qo_len - kv_len)
    longest = max(kv - lo for kv, lo in zip(kv_lens, kv_los))
    total_tiles = sum(tiles)

    def chunks_of(r: int, chunk: int) -> int:
        return max(1, -(-(kv_lens[r] - kv_los[r]) // chunk))

    def items_for(chunk: int) -> int:
        return sum(tiles[r] * chunks_of(r, chunk) for r in range(batch))

    chunk = split_chunk_tokens(longest, disable_split_kv, total_tiles * num_kv_heads >= max_ctas, fixed_split_tokens,
                               min_chunk_tokens, num_kv_heads, max_ctas, chunk_align_tokens, items_for)
    num_work = items_for(chunk)
    if num_work > layout.capacity:
        raise PlanError(f"the plan needs {num_work} work items ({total_tiles} q tiles of {tile_rows} rows, kv chunks "
                        f"of {chunk} tokens) but has room for {layout.capacity}; use a larger fixed_split_size or "
                        "disable_split_kv")

    image = [0] * layout.size
    off = layout.offsets()
    merge = off["off_merge_indptr"]
    items = []
    slots = 0
    for r in range(batch):
        chunks = chunks_of(r, chunk)
        split = chunks > 1
        for tile in range(tiles[r]):
            seen_begin, seen_end = tile_kv_range(qo_lens[r], kv_lens[r], tile, tile_rows, g, causal, window_left)
            for c in range(chunks):
                begin = max(kv_los[r] + c * chunk, seen_begin)
                end = max(begin, min(kv_lens[r], kv_los[r] + (c + 1) * chunk, seen_end))
                items.append((r, tile, begin, end, slots + c if split else -1))
        for t in range(qo_lens[r]):
            row = qo_indptr[r] + t
            image[merge + row + 1] = image[merge + row] + (chunks if split else 0)
        if split:
            slots += qo_lens[r] * chunks
        image[off["off_kv_len"] + r] = kv_lens[r]
        image[off["off_num_chunks"] + r] = chunks
    image[merge + total_rows + 1 : merge + layout.row_capacity + 1] = [slots] * (layout.row_capacity - total_rows)

    items.sort(key=lambda item: -(item[3] - item[2]))  # stable: longest first
    names = ("work_request", "work_qo_tile", "work_kv_begin", "work_kv_end", "work_partial")
    for i, item in enumerate(items):
        for name, value in zip(names, item):
            image[off[f"off_{name}"] + i] = value
    image[off["off_qo_indptr"] : off["off_qo_indptr"] + batch + 1] = qo_indptr
    image[off["off_kv_indptr"] : off["off_kv_indptr"] + batch + 1] = kv_indptr
    image[PLAN_HEADER.index("num_work")] = num_work
    image[PLAN_HEADER.index("num_partials")] = slots
    max_chunks = max(chunks_of(r, chunk) for r in range(batch))
    return PrefillPlanResult(image, num_work, slots, tile_rows, chunk, max_chunks, rows_without_keys)
