// Role: the batch-decode planner (host code): validates the page table's host arrays and cuts
// requests into work items that fill the GPU, writing the int32 plan image plan() uploads.
//
// Contract (mirrored exactly by attnforge.planner, the Python oracle used in property tests):
//   kv_len[r]   = pages ? (pages - 1) * page_size + last_page_len[r] : 0
//   kv range[r] = [max(0, kv_len - 1 - window_left), kv_len)   (whole range without a window)
//   chunk       = the whole longest range when splitting is off; else fixed_split_tokens if set
//                 (whatever the batch); else the whole longest range when the batch alone fills
//                 the GPU; else the smallest chunk >= min_chunk_tokens
//                 whose work-item count times ctas_per_request fits max_ctas (binary search),
//                 rounded up to a multiple of chunk_align_tokens (the kernel's kv tile) unless
//                 that passes the longest range or keeps < 7/8 of the items (split_kv.h).
//   Every request gets >= 1 work item (an empty one writes o = 0, lse = -inf). Requests cut into
//   several chunks get consecutive fp32 partial slots; whole requests write o directly (-1).
//   Work items are ordered longest first (stable), so long tails start early.
//   merge_counters[batch * ctas_per_request] (the fused merge's arrival counts) are all 0.
// Must not: touch the GPU. Its cost is what a serving engine pays every step: keep it O(batch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/plan_image.cuh"
#include "error.h"
#include "split_kv.h"

namespace attnforge::host {

template <typename Args, typename Info>
int32_t plan_decode(const Args& a, Info* info) {
  constexpr int32_t kBadInput = 1;
  const auto* indptr = static_cast<const int32_t*>(a.indptr);
  const auto* last_page_len = static_cast<const int32_t*>(a.last_page_len);
  auto* image = static_cast<int32_t*>(a.image);
  const int batch = a.batch_size;
  const auto at = [](const char* name, int i) { return std::string(name) + "[" + std::to_string(i) + "]"; };

  if (indptr[0] < 0) return fail(kBadInput, "indptr[0] = " + std::to_string(indptr[0]) + ": indptr must start at >= 0");
  if (indptr[batch] > a.num_indices) {
    return fail(kBadInput, "indptr[-1] = " + std::to_string(indptr[batch]) + " but indices holds only " +
                               std::to_string(a.num_indices) + " page ids");
  }
  std::vector<int32_t> range_begin(batch), range_len(batch);
  int32_t longest = 0;
  for (int r = 0; r < batch; ++r) {
    const int32_t pages = indptr[r + 1] - indptr[r];
    const int32_t last = last_page_len[r];
    if (pages < 0) {
      return fail(kBadInput, at("indptr", r + 1) + " = " + std::to_string(indptr[r + 1]) + " < " + at("indptr", r) +
                                 " = " + std::to_string(indptr[r]) + ": indptr must be non-decreasing");
    }
    const int32_t lo = pages > 0 ? 1 : 0;
    if (last < lo || last > a.page_size) {
      return fail(kBadInput, at("last_page_len", r) + " = " + std::to_string(last) + ", expected a value in [" +
                                 std::to_string(lo) + ", page_size=" + std::to_string(a.page_size) + "]" +
                                 (pages > 0 ? "" : " (the request has no pages)"));
    }
    const int32_t kv_len = pages > 0 ? (pages - 1) * a.page_size + last : 0;
    const int32_t begin = a.window_left >= 0 ? std::max(0, kv_len - 1 - a.window_left) : 0;
    range_begin[r] = begin;
    range_len[r] = kv_len - begin;
    longest = std::max(longest, range_len[r]);
  }

  const auto items_for = [&](int64_t chunk) {
    int64_t items = 0;
    for (int r = 0; r < batch; ++r) items += std::max<int64_t>(1, (range_len[r] + chunk - 1) / chunk);
    return items;
  };
  const int64_t chunk = split_chunk_tokens(longest, a.disable_split_kv, int64_t(batch) * a.ctas_per_request >= a.max_ctas,
                                           a.fixed_split_tokens, a.min_chunk_tokens, a.ctas_per_request, a.max_ctas,
                                           a.chunk_align_tokens, items_for);
  const int64_t num_work = items_for(chunk);
  if (num_work > a.work_capacity) {
    return fail(kBadInput, "the plan needs " + std::to_string(num_work) + " work items (kv chunks of " +
                               std::to_string(chunk) + " tokens) but has room for " + std::to_string(a.work_capacity) +
                               "; use a larger fixed_split_size or disable_split_kv");
  }

  // Work items in request order, then reordered longest first.
  std::vector<int32_t> w_request, w_begin, w_end, w_partial;
  w_request.reserve(num_work); w_begin.reserve(num_work); w_end.reserve(num_work); w_partial.reserve(num_work);
  int32_t* partial_indptr = image + a.off_partial_indptr;
  partial_indptr[0] = 0;
  int32_t max_chunks = 0;
  for (int r = 0; r < batch; ++r) {
    const int32_t chunks = static_cast<int32_t>(std::max<int64_t>(1, (range_len[r] + chunk - 1) / chunk));
    max_chunks = std::max(max_chunks, chunks);
    const int32_t end = range_begin[r] + range_len[r];
    for (int32_t c = 0; c < chunks; ++c) {
      w_request.push_back(r);
      w_begin.push_back(static_cast<int32_t>(std::min<int64_t>(end, range_begin[r] + c * chunk)));
      w_end.push_back(static_cast<int32_t>(std::min<int64_t>(end, range_begin[r] + (c + 1) * chunk)));
      w_partial.push_back(chunks > 1 ? partial_indptr[r] + c : -1);
    }
    partial_indptr[r + 1] = partial_indptr[r] + (chunks > 1 ? chunks : 0);
  }
  std::vector<int32_t> order(num_work);
  for (int32_t w = 0; w < num_work; ++w) order[w] = w;
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return w_end[x] - w_begin[x] > w_end[y] - w_begin[y]; });
  for (int32_t i = 0; i < num_work; ++i) {
    const int32_t w = order[i];
    image[a.off_work_request + i] = w_request[w];
    image[a.off_work_begin + i] = w_begin[w];
    image[a.off_work_end + i] = w_end[w];
    image[a.off_work_partial + i] = w_partial[w];
  }
  for (int r = 0; r <= batch; ++r) image[a.off_indptr + r] = indptr[r];
  for (int r = 0; r < batch; ++r) image[a.off_kv_len + r] = range_begin[r] + range_len[r];
  // The fused merge's counters start at 0 (the kernel leaves them so); zeroed every plan so that a
  // run cut short, or a device image never written before, cannot leave a stale count behind.
  std::fill_n(image + a.off_merge_counters, size_t(batch) * size_t(a.ctas_per_request), 0);
  image[common::kPlanNumWork] = static_cast<int32_t>(num_work);
  image[common::kPlanError] = 0;
  image[common::kPlanNumPartials] = partial_indptr[batch];
  image[3] = 0;

  info->num_work = static_cast<int32_t>(num_work);
  info->num_partials = partial_indptr[batch];
  info->chunk_tokens = static_cast<int32_t>(chunk);
  info->max_chunks = max_chunks;
  return 0;
}

}  // namespace attnforge::host
