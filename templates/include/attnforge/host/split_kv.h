// Role: the split-KV chunk choice both planners share (host code).
// Contract: the whole longest kv range (one chunk per range) when splitting is off or the unsplit
//   work already fills the GPU; else fixed_split_tokens when set; else the smallest chunk >=
//   min_chunk_tokens whose work-item count times ctas_per_item fits max_ctas (binary search; the
//   count never grows as the chunk grows, so the search is exact).
// Must not: know what a work item is; items_for(chunk) counts them for its caller.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attnforge::host {

template <typename ItemsFor>
int64_t split_chunk_tokens(int64_t longest, bool unsplit, int64_t fixed_split_tokens, int64_t min_chunk_tokens,
                           int64_t ctas_per_item, int64_t max_ctas, const ItemsFor& items_for) {
  if (unsplit) return std::max<int64_t>(longest, 1);
  if (fixed_split_tokens > 0) return fixed_split_tokens;
  int64_t lo = min_chunk_tokens, hi = std::max(longest, min_chunk_tokens);
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (items_for(mid) * ctas_per_item <= max_ctas) hi = mid; else lo = mid + 1;
  }
  return lo;
}

}  // namespace attnforge::host
