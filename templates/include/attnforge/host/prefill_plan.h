// Role: the FA2 batch-prefill planner (host code): validates the host arrays of a paged or ragged
// batch and cuts it into (request, q tile, kv chunk) work items, writing the int32 plan image.
//
// Contract (mirrored line for line by attnforge.prefill_planner, the Python oracle of the tests):
//   kv_len[r]    = paged ? (pages ? (pages - 1) * page_size + last_page_len : 0) : token count
//   q_pos(t)     = t + kv_len - qo_len; packed row p of a request is (token p / g, head p % g)
//   cta_tile_q   = fixed_cta_tile_q when > 0 (fa3); else 128 if the packed-length estimate > 64 and
//                  the module has it (max_cta_tile_q), else 64 if > 16,
//                  else 16; the estimate is total_rows * g / B, or under CUDA graphs the static
//                  (row_capacity - B + 1) * g, so a captured graph keeps its variant.
//   q tiles[r]   = ceil(qo_len * g / cta_tile_q)  (a request without queries has none)
//   kv range[r]  = [window ? max(0, q_pos(0) - window_left) : 0, kv_len): what any of its rows sees
//   chunk        = as decode, over q tiles x Hkv CTAs: the whole longest range when splitting is
//                  off or the q tiles alone fill max_ctas; else fixed_split_tokens if set; else the
//                  smallest chunk >= min_chunk_tokens whose item count x Hkv fits max_ctas,
//                  rounded up to a multiple of chunk_align_tokens (the chosen variant's kv tile)
//                  unless that passes the longest range or keeps < 7/8 of the items (split_kv.h).
//   num_chunks[r]= max(1, ceil(range / chunk)); chunk c = [lo + c*chunk, lo + (c+1)*chunk), cut to range.
//   item (r, tile, c) reads chunk c cut to the tile's own range: from its first row's window edge
//                  to just past its last row's causal edge. The chunk count is per request (the
//                  partial-slot formula needs one count for all rows), so a cut may leave an item
//                  empty (begin == end): it writes o = 0, lse = -inf for its rows, which the merge
//                  weighs as nothing. Every (row, chunk) slot is thus written exactly once.
//   Partial slot of (r, chunk c, token t) = base[r] + t * num_chunks[r] + c for split requests
//   (base = slots of the split requests before r); an unsplit request writes o directly (-1).
//   merge_indptr[i+1] - merge_indptr[i] = num_chunks of row i's request if split, else 0; rows
//   past the batch (CUDA-graph padding) get empty ranges. Work items are ordered longest first
//   (stable); items past num_work are zero and never read (their CTAs exit on plan[num_work]).
// Must not: touch the GPU, or size anything from the batch under CUDA graphs (the caller's
// layout is static). Its cost is paid every serving step: keep it O(work items + rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/plan_image.cuh"
#include "error.h"
#include "split_kv.h"

namespace attnforge::host {

namespace prefill {

constexpr int32_t kBadInput = 1;

// The q tile height of every CTA in this plan: tall tiles amortize
// each kv load over more rows, but on short prompts they would run mostly empty.
inline int32_t cta_tile_q(int64_t packed_len_estimate, int32_t max_cta_tile_q) {
  if (packed_len_estimate > 64 && max_cta_tile_q >= 128) return 128;
  return packed_len_estimate > 16 ? 64 : 16;
}

struct Request {
  int64_t qo_len = 0;
  int64_t kv_len = 0;
  int64_t kv_lo = 0;  // first kv token any of its rows sees (the window's edge at token 0)
  int64_t tiles = 0;  // q tiles of cta_tile_q packed rows
  int64_t chunks = 1;
};

struct KvRange {
  int64_t begin, end;
};

// The kv tokens some row of q tile `tile` sees: the window cuts at the first row's edge (rows
// further down see further right), causal cuts just past the last row's position.
inline KvRange tile_kv_range(const Request& r, int64_t tile, int32_t tile_rows, int32_t group, bool causal,
                             int32_t window_left) {
  const int64_t shift = r.kv_len - r.qo_len;  // q_pos(t) = t + shift
  const int64_t first = tile * tile_rows / group;
  const int64_t last = (std::min(r.qo_len * group, (tile + 1) * tile_rows) - 1) / group;
  const int64_t begin = window_left >= 0 ? std::max<int64_t>(0, first + shift - window_left) : 0;
  const int64_t end = causal ? std::clamp<int64_t>(last + shift + 1, 0, r.kv_len) : r.kv_len;
  return {begin, end};
}

inline std::string at(const char* name, int64_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

// "" when indptr[0..batch] starts at 0 (or >= 0), never decreases and ends at most at `limit`;
// else the message naming the first bad entry. `room` says what `limit` counts, for the message.
inline std::string check_indptr(const int32_t* indptr, int batch, const char* name, bool start_at_zero,
                                int64_t limit, const std::string& room) {
  if (start_at_zero ? indptr[0] != 0 : indptr[0] < 0) {
    return at(name, 0) + " = " + std::to_string(indptr[0]) + ": " + name + " must start at " +
           (start_at_zero ? "0" : ">= 0");
  }
  for (int r = 0; r < batch; ++r) {
    if (indptr[r + 1] < indptr[r]) {
      return at(name, r + 1) + " = " + std::to_string(indptr[r + 1]) + " < " + at(name, r) + " = " +
             std::to_string(indptr[r]) + ": " + name + " must be non-decreasing";
    }
  }
  if (indptr[batch] > limit) {
    return std::string(name) + "[-1] = " + std::to_string(indptr[batch]) + " but " + room;
  }
  return "";
}

}  // namespace prefill

template <typename Args, typename Info>
int32_t plan_prefill(const Args& a, Info* info) {
  using prefill::kBadInput;
  const auto* qo_indptr = static_cast<const int32_t*>(a.qo_indptr);
  const auto* kv_indptr = static_cast<const int32_t*>(a.kv_indptr);
  const auto* last_page_len = static_cast<const int32_t*>(a.last_page_len);
  auto* image = static_cast<int32_t*>(a.image);
  const int batch = a.batch_size;
  const int32_t g = a.group_size;

  if (batch < 1) return fail(kBadInput, "batch_size = " + std::to_string(batch) + ": expected at least one request");
  const std::string indices = std::to_string(a.num_indices);
  std::string bad = prefill::check_indptr(
      qo_indptr, batch, "qo_indptr", true, a.row_capacity,
      "the plan has room for row_capacity=" + std::to_string(a.row_capacity) + " query rows");
  if (bad.empty()) {
    bad = prefill::check_indptr(kv_indptr, batch, "kv_indptr", false, a.num_indices,
                                a.paged ? "indices holds only " + indices + " page ids"
                                        : "k and v hold only " + indices + " tokens");
  }
  if (!bad.empty()) return fail(kBadInput, bad);

  const int64_t total_rows = qo_indptr[batch];
  const int64_t estimate = a.cuda_graph ? (int64_t(a.row_capacity) - batch + 1) * g : total_rows * g / batch;
  const int32_t tile_rows = a.fixed_cta_tile_q > 0 ? a.fixed_cta_tile_q : prefill::cta_tile_q(estimate, a.max_cta_tile_q);

  std::vector<prefill::Request> requests(batch);
  int64_t longest = 0, total_tiles = 0, rows_without_keys = 0;
  for (int r = 0; r < batch; ++r) {
    prefill::Request& q = requests[r];
    const int64_t extent = kv_indptr[r + 1] - kv_indptr[r];
    q.kv_len = extent;
    if (a.paged) {
      const int32_t lo = extent > 0 ? 1 : 0;
      const int32_t last = last_page_len[r];
      if (last < lo || last > a.page_size) {
        return fail(kBadInput, prefill::at("last_page_len", r) + " = " + std::to_string(last) +
                                   ", expected a value in [" + std::to_string(lo) + ", page_size=" +
                                   std::to_string(a.page_size) + "]" + (extent > 0 ? "" : " (the request has no pages)"));
      }
      q.kv_len = extent > 0 ? (extent - 1) * a.page_size + last : 0;
    }
    q.qo_len = qo_indptr[r + 1] - qo_indptr[r];
    q.kv_lo = a.window_left >= 0 ? std::max<int64_t>(0, q.kv_len - q.qo_len - a.window_left) : 0;
    q.tiles = (q.qo_len * g + tile_rows - 1) / tile_rows;
    longest = std::max(longest, q.kv_len - q.kv_lo);
    total_tiles += q.tiles;
    // FlashInfer accepts causal prompts longer than their kv: the first rows see no key.
    if (a.causal) rows_without_keys += std::max<int64_t>(0, q.qo_len - q.kv_len);
  }

  const auto chunks_of = [](const prefill::Request& q, int64_t chunk) {
    return std::max<int64_t>(1, (q.kv_len - q.kv_lo + chunk - 1) / chunk);
  };
  const auto items_for = [&](int64_t chunk) {
    int64_t items = 0;
    for (const auto& q : requests) items += q.tiles * chunks_of(q, chunk);
    return items;
  };
  const int64_t chunk = split_chunk_tokens(longest, a.disable_split_kv, total_tiles * a.num_kv_heads >= a.max_ctas,
                                           a.fixed_split_tokens, a.min_chunk_tokens, a.num_kv_heads, a.max_ctas,
                                           a.chunk_align_tokens, items_for);
  const int64_t num_work = items_for(chunk);
  if (num_work > a.work_capacity) {
    return fail(kBadInput, "the plan needs " + std::to_string(num_work) + " work items (" +
                               std::to_string(total_tiles) + " q tiles of " + std::to_string(tile_rows) +
                               " rows, kv chunks of " + std::to_string(chunk) + " tokens) but has room for " +
                               std::to_string(a.work_capacity) + "; use a larger fixed_split_size or disable_split_kv");
  }

  // Per-request arrays and merge_indptr; work items in (request, q tile, chunk) order.
  int32_t* merge_indptr = image + a.off_merge_indptr;
  std::vector<int32_t> w_request, w_tile, w_begin, w_end, w_partial;
  for (auto* v : {&w_request, &w_tile, &w_begin, &w_end, &w_partial}) v->reserve(num_work);
  int64_t max_chunks = 0, slots = 0;
  merge_indptr[0] = 0;
  for (int r = 0; r < batch; ++r) {
    prefill::Request& q = requests[r];
    q.chunks = chunks_of(q, chunk);
    max_chunks = std::max(max_chunks, q.chunks);
    const bool split = q.chunks > 1;
    for (int64_t tile = 0; tile < q.tiles; ++tile) {
      const prefill::KvRange seen = prefill::tile_kv_range(q, tile, tile_rows, g, a.causal, a.window_left);
      for (int64_t c = 0; c < q.chunks; ++c) {
        const int64_t begin = std::max(q.kv_lo + c * chunk, seen.begin);
        const int64_t end = std::max(begin, std::min({q.kv_len, q.kv_lo + (c + 1) * chunk, seen.end}));
        w_request.push_back(r);
        w_tile.push_back(static_cast<int32_t>(tile));
        w_begin.push_back(static_cast<int32_t>(begin));
        w_end.push_back(static_cast<int32_t>(end));
        w_partial.push_back(split ? static_cast<int32_t>(slots + c) : -1);
      }
    }
    for (int64_t t = 0; t < q.qo_len; ++t) {
      const int64_t row = qo_indptr[r] + t;
      merge_indptr[row + 1] = merge_indptr[row] + static_cast<int32_t>(split ? q.chunks : 0);
    }
    if (split) slots += q.qo_len * q.chunks;
    image[a.off_kv_len + r] = static_cast<int32_t>(q.kv_len);
    image[a.off_num_chunks + r] = static_cast<int32_t>(q.chunks);
  }
  std::fill(merge_indptr + total_rows + 1, merge_indptr + a.row_capacity + 1, static_cast<int32_t>(slots));

  std::vector<int32_t> order(num_work);
  for (int32_t w = 0; w < num_work; ++w) order[w] = w;
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return w_end[x] - w_begin[x] > w_end[y] - w_begin[y]; });
  const struct {
    const std::vector<int32_t>& values;
    int32_t offset;
  } work_arrays[] = {{w_request, a.off_work_request}, {w_tile, a.off_work_qo_tile}, {w_begin, a.off_work_kv_begin},
                     {w_end, a.off_work_kv_end}, {w_partial, a.off_work_partial}};
  for (const auto& array : work_arrays) {
    int32_t* out = image + array.offset;
    for (int32_t i = 0; i < num_work; ++i) out[i] = array.values[order[i]];
    std::fill(out + num_work, out + a.work_capacity, 0);
  }
  std::copy(qo_indptr, qo_indptr + batch + 1, image + a.off_qo_indptr);
  std::copy(kv_indptr, kv_indptr + batch + 1, image + a.off_kv_indptr);
  image[common::kPlanNumWork] = static_cast<int32_t>(num_work);
  image[common::kPlanError] = 0;
  image[common::kPlanNumPartials] = static_cast<int32_t>(slots);
  image[common::kPlanJobCounter] = 0;  // each fa3 launch leaves it 0 again

  info->num_work = static_cast<int32_t>(num_work);
  info->num_partials = static_cast<int32_t>(slots);
  info->cta_tile_q = tile_rows;
  info->chunk_tokens = static_cast<int32_t>(chunk);
  info->max_chunks = static_cast<int32_t>(max_chunks);
  info->causal_rows_without_keys = static_cast<int32_t>(rows_without_keys);
  return 0;
}

}  // namespace attnforge::host
