// Role: the split-KV chunk choice both planners share (host code).
// Contract: the whole longest kv range (one chunk per range) when splitting is off; else
//   fixed_split_tokens when set, whatever the batch (as given: fixed_split_size is FlashInfer's, in
//   pages, and a request's chunks, so its reduction order, must not depend on what else is in the
//   batch: batch-invariant serving relies on it); else the whole longest range when the unsplit
//   work already fills the GPU; else the smallest chunk >= min_chunk_tokens whose work-item count
//   times ctas_per_item fits max_ctas (binary search; the count never grows as the chunk grows, so
//   the search is exact), rounded up to a multiple of align_tokens, the kernel's kv tile, unless
//   that passes the longest range (then every range is one chunk either way) or leaves fewer than
//   7/8 of the search's work items (kAlignKeepsItems); then the search's chunk is kept.
// Must not: know what a work item is; items_for(chunk) counts them for its caller.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attnforge::host {

// Rounding a chunk up to whole kv tiles never adds tiles to a work item's critical path (ceil(chunk /
// tile) is unchanged) but can cut the item count, and the items are what fill the SMs and put bytes
// in flight: just past slots x tile tokens it nearly halves them (batch 1 x 4300 tokens, 33 slots,
// tile 128: the search's 131 gives 33 items, 256 only 17, half the SMs idle). Round only where at
// least kAlignKeepsItems of the items survive (16384 tokens: 497 -> 512, 33 -> 32 items).
inline constexpr int64_t kAlignKeepsItemsNum = 7, kAlignKeepsItemsDen = 8;

template <typename ItemsFor>
int64_t split_chunk_tokens(int64_t longest, bool disabled, bool fills_gpu, int64_t fixed_split_tokens,
                           int64_t min_chunk_tokens, int64_t ctas_per_item, int64_t max_ctas, int64_t align_tokens,
                           const ItemsFor& items_for) {
  if (disabled) return std::max<int64_t>(longest, 1);
  if (fixed_split_tokens > 0) return fixed_split_tokens;
  if (fills_gpu) return std::max<int64_t>(longest, 1);
  int64_t lo = min_chunk_tokens, hi = std::max(longest, min_chunk_tokens);
  int64_t hi_items = -1;  // items_for(hi), once the search has counted it (each count is a pass over the batch)
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t items = items_for(mid);
    if (items * ctas_per_item <= max_ctas) hi = mid, hi_items = items; else lo = mid + 1;
  }
  // The kernel's kv tile alone, not lcm(page, tile): rounding up never adds work items, so the
  // chunks stay within the slots; every tile but a range's last is full, and page sizes dividing
  // the tile (1-64, the common ones) give page-aligned chunks too, while a larger page (a multiple
  // of the tile) keeps each tile inside one page anyway, and whole-page chunks would leave slots
  // idle (1024-token pages at 16k tokens: 16 chunks for 33 slots).
  const int64_t align = std::max<int64_t>(align_tokens, 1);
  const int64_t aligned = (lo + align - 1) / align * align;
  if (aligned > longest) return lo;
  const int64_t lo_items = hi_items >= 0 ? hi_items : items_for(lo);  // lo == hi here
  return items_for(aligned) * kAlignKeepsItemsDen >= lo_items * kAlignKeepsItemsNum ? aligned : lo;
}

}  // namespace attnforge::host
