"""Decode planning: the plan-image layout, sizing helpers, and the pure-Python planner.

The planner that runs in plan() is the C++ one inside each module (host/decode_plan.h): it keeps
plan() within its budget at large batches. `plan_decode_oracle` here implements the same contract
line for line; property tests check the two agree and that the plan covers every kv token once.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnforge.codegen.abi import PLAN_HEADER
from attnforge.codegen.render import DECODE_HEADS_PER_CTA

# Split-KV never cuts a request into chunks shorter than this: shorter chunks cost more in merge
# traffic than they win in parallelism.
MIN_CHUNK_TOKENS = 128
# Rounding the chunk up to whole kv tiles must keep at least this share of the search's work items
# (host/split_kv.h, kAlignKeepsItems: whole tiles never shorten a work item, fewer items idle SMs).
ALIGN_KEEPS_ITEMS = (7, 8)
# Upper bound of resident CTAs per SM for any decode variant (2048 threads / 128 per CTA); used
# only to size workspaces before a module is loaded.
MAX_CTAS_PER_SM_BOUND = 16


def heads_per_cta(group_size: int) -> tuple[int, int]:
    """(heads per CTA, head tiles) for a GQA group: the smallest variant holding the whole group,
    else the largest variant tiled over it. Idle head slots cost only arithmetic, while every
    extra tile re-reads the kv head (from L2 when tiles run side by side)."""
    for heads in DECODE_HEADS_PER_CTA:
        if group_size <= heads:
            return heads, 1
    heads = DECODE_HEADS_PER_CTA[-1]
    return heads, -(-group_size // heads)


def work_capacity(batch_size: int, max_ctas: int, ctas_per_request: int) -> int:
    """Most work items the automatic planner can emit: one per request, or, when it splits, at
    most max_ctas // ctas_per_request (its binary search guarantees that)."""
    return max(batch_size, max_ctas // ctas_per_request, 1)


class ImageLayout:
    """A plan image's layout: the header, then the arrays `_arrays()` names, in order (int32 elements)."""

    def _arrays(self) -> tuple[tuple[str, int], ...]:
        raise NotImplementedError

    def offsets(self) -> dict[str, int]:
        out, cursor = {}, len(PLAN_HEADER)
        for name, length in self._arrays():
            out[f"off_{name}"] = cursor
            cursor += length
        return out

    @property
    def size(self) -> int:
        return len(PLAN_HEADER) + sum(length for _, length in self._arrays())


@dataclass(frozen=True)
class PlanLayout(ImageLayout):
    """The decode plan image: the header, indptr[batch+1], four work arrays of `capacity` entries
    (request, begin, end, partial slot), partial_indptr[batch+1], kv_len[batch] (the position
    encodings place the query at kv_len - 1), and the fused merge's arrival counters, one per CTA
    unit of a request: [batch, ctas_per_request], zeroed by plan()."""

    batch_size: int
    capacity: int
    ctas_per_request: int

    def _arrays(self) -> tuple[tuple[str, int], ...]:
        return (("indptr", self.batch_size + 1), ("work_request", self.capacity), ("work_begin", self.capacity),
                ("work_end", self.capacity), ("work_partial", self.capacity), ("partial_indptr", self.batch_size + 1),
                ("kv_len", self.batch_size), ("merge_counters", self.batch_size * self.ctas_per_request))


def partial_bytes(num_partials: int, num_qo_heads: int, head_dim: int) -> tuple[int, int]:
    """(bytes of fp32 partial outputs, bytes of fp32 partial lse), the first rounded up to 256."""
    v_bytes = num_partials * num_qo_heads * head_dim * 4
    return -(-v_bytes // 256) * 256, num_partials * num_qo_heads * 4


@dataclass(frozen=True)
class PlanResult:
    image: list[int]
    num_work: int
    num_partials: int
    chunk_tokens: int
    max_chunks: int


class PlanError(ValueError):
    pass


def split_chunk_tokens(longest: int, disabled: bool, fills_gpu: bool, fixed_split_tokens: int,
                       min_chunk_tokens: int, ctas_per_item: int, max_ctas: int, align_tokens: int, items_for) -> int:
    """The split-KV chunk both planners use (host/split_kv.h, line for line): the whole longest
    range when splitting is disabled, else the fixed split (as given, whatever the batch), else the
    whole longest range when the unsplit work fills the GPU, else the smallest chunk >= min_chunk_tokens
    whose item count times ctas_per_item fits max_ctas, rounded up to a multiple of align_tokens
    (the kernel's kv tile) unless that passes the longest range or keeps fewer than 7/8 of the
    search's work items (ALIGN_KEEPS_ITEMS)."""
    if disabled:
        return max(longest, 1)
    if fixed_split_tokens > 0:
        return fixed_split_tokens
    if fills_gpu:
        return max(longest, 1)
    lo, hi = min_chunk_tokens, max(longest, min_chunk_tokens)
    hi_items = None  # items_for(hi), once the search has counted it (each count is a pass over the batch)
    while lo < hi:
        mid = (lo + hi) // 2
        items = items_for(mid)
        if items * ctas_per_item <= max_ctas:
            hi, hi_items = mid, items
        else:
            lo = mid + 1
    align = max(align_tokens, 1)  # why the tile and not lcm(page, tile): host/split_kv.h
    aligned = -(-lo // align) * align
    if aligned > longest:
        return lo
    keep_num, keep_den = ALIGN_KEEPS_ITEMS
    lo_items = items_for(lo) if hi_items is None else hi_items  # lo == hi here
    return aligned if items_for(aligned) * keep_den >= lo_items * keep_num else lo


def plan_decode_oracle(
    indptr: list[int],
    last_page_len: list[int],
    *,
    page_size: int,
    num_indices: int,
    ctas_per_request: int,
    max_ctas: int,
    window_left: int = -1,
    fixed_split_tokens: int = 0,
    disable_split_kv: bool = False,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
    chunk_align_tokens: int = 1,
    layout: PlanLayout,
) -> PlanResult:
    """Reference implementation of host/decode_plan.h (see its contract)."""
    batch = len(last_page_len)
    if indptr[0] < 0:
        raise PlanError(f"indptr[0] = {indptr[0]}: indptr must start at >= 0")
    if indptr[batch] > num_indices:
        raise PlanError(f"indptr[-1] = {indptr[batch]} but indices holds only {num_indices} page ids")
    begins, lengths = [], []
    for r in range(batch):
        pages = indptr[r + 1] - indptr[r]
        if pages < 0:
            raise PlanError(f"indptr[{r + 1}] < indptr[{r}]: indptr must be non-decreasing")
        low = 1 if pages > 0 else 0
        if not low <= last_page_len[r] <= page_size:
            raise PlanError(f"last_page_len[{r}] = {last_page_len[r]}, expected a value in [{low}, page_size={page_size}]")
        kv_len = (pages - 1) * page_size + last_page_len[r] if pages > 0 else 0
        begin = max(0, kv_len - 1 - window_left) if window_left >= 0 else 0
        begins.append(begin)
        lengths.append(kv_len - begin)
    longest = max(lengths, default=0)

    def items_for(chunk: int) -> int:
        return sum(max(1, -(-n // chunk)) for n in lengths)

    chunk = split_chunk_tokens(longest, disable_split_kv, batch * ctas_per_request >= max_ctas, fixed_split_tokens,
                               min_chunk_tokens, ctas_per_request, max_ctas, chunk_align_tokens, items_for)
    num_work = items_for(chunk)
    if num_work > layout.capacity:
        raise PlanError(f"the plan needs {num_work} work items but has room for {layout.capacity}")

    image = [0] * layout.size  # the merge counters included: 0, as the fused merge leaves them
    off = layout.offsets()
    items = []
    partial_indptr = [0]
    for r in range(batch):
        chunks = max(1, -(-lengths[r] // chunk))
        end = begins[r] + lengths[r]
        for c in range(chunks):
            slot = partial_indptr[r] + c if chunks > 1 else -1
            items.append((r, min(end, begins[r] + c * chunk), min(end, begins[r] + (c + 1) * chunk), slot))
        partial_indptr.append(partial_indptr[r] + (chunks if chunks > 1 else 0))
    items.sort(key=lambda item: -(item[2] - item[1]))  # stable: longest first
    for i, (request, begin, end, slot) in enumerate(items):
        image[off["off_work_request"] + i] = request
        image[off["off_work_begin"] + i] = begin
        image[off["off_work_end"] + i] = end
        image[off["off_work_partial"] + i] = slot
    image[off["off_indptr"] : off["off_indptr"] + batch + 1] = indptr[: batch + 1]
    image[off["off_partial_indptr"] : off["off_partial_indptr"] + batch + 1] = partial_indptr
    image[off["off_kv_len"] : off["off_kv_len"] + batch] = [b + n for b, n in zip(begins, lengths)]
    image[PLAN_HEADER.index("num_work")] = num_work
    image[PLAN_HEADER.index("num_partials")] = partial_indptr[batch]
    max_chunks = max((max(1, -(-n // chunk)) for n in lengths), default=0)
    return PlanResult(image, num_work, partial_indptr[batch], chunk, max_chunks)
