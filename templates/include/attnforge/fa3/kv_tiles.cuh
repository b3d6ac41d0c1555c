// Role: how a kv tile reaches shared memory, decided alike by producer and consumers: paged rows
//   (page id and row in page, bad ids caught), a gathered tile's row offsets, whether a tile comes
//   by TMA boxes or a cp.async gather, and whether consumer warpgroup 1 transposes fp8 V.
// Contract: tiles inside [begin, end) come by TMA when the tile is whole pages (page size a
//   multiple of 8 rows) or lies in one page, ragged tiles whole; the rest are gathered (zero-filled
//   past `end`, so P.V never meets rows past the request). A page id outside [0, num_pages) is
//   never read (page 0 is) and raises the item's bad-page flag: its rows come out NaN and the
//   plan's error word gets kPlanErrorBadPage.
// Must not: issue copies (producer.cuh) or wait on barriers.
#pragma once

#include "mask.cuh"

namespace attnforge::fa3 {

// A paged token's (page, row in page). A page id outside [0, num_pages) reads page 0 instead and
// raises `bad_page`: the job's rows then come out NaN (see store_rows).
__device__ __forceinline__ PageRow resolve_page(const int32_t* page_ids, const common::FastDivmod& page_size,
                                                int num_pages, int token, bool& bad_page) {
  PageRow row;
  int page_index;
  page_size.divmod(token, page_index, row.in_page);
  const int id = __ldg(page_ids + page_index);
  const bool ok = static_cast<unsigned>(id) < static_cast<unsigned>(num_pages);
  bad_page |= !ok;
  row.page = ok ? id : 0;
  return row;
}

// Paged KV, gathered tile: thread `row` looks its token's page up once for both K and V; rows
// past `end` get page -1 (zero-filled).
template <typename T>
__device__ __forceinline__ void fill_page_table(PageRow* table, const typename T::Params& p, const int32_t* page_ids,
                                                const common::FastDivmod& page_size, int first, int end, int tid,
                                                bool& bad_page) {
  if (tid >= T::kBlockN) return;
  const int token = first + tid;
  table[tid] = token < end ? resolve_page(page_ids, page_size, p.num_pages, token, bad_page) : PageRow{-1, 0};
}

// A gathered tile's row offsets (elements): through the page table (paged), or from the request's
// first token (ragged); -1 past `end`, which the copies zero-fill.
template <typename T>
__device__ __forceinline__ auto gathered_rows(const PageRow* table, int first, int end, int kv_token_base,
                                              int64_t page_stride, int64_t token_stride) {
  return [=](int row) -> int64_t {
    if constexpr (T::kPagedKV) {
      const PageRow r = table[row];
      return r.page < 0 ? int64_t(-1) : int64_t(r.page) * page_stride + int64_t(r.in_page) * token_stride;
    } else {
      return first + row < end ? int64_t(kv_token_base + first + row) * token_stride : int64_t(-1);
    }
  };
}

// Whether the tile at `first` comes by TMA (the same answer in every producer thread): it starts a
// page, or lies in one. The producer is bound by its instructions' latency (fp8 paged), so the
// page size divides by multiplication.
template <typename T>
__device__ __forceinline__ bool tile_is_boxed(const KernelArgs<T>& args, const WorkTile& w,
                                              const common::FastDivmod& page_size, int first) {
  if (args.box_rows == 0) return false;
  // Ragged K past w.end (V transposed ahead): the next request's keys or the map's zeros, masked;
  // unless the whole tensor is shorter than a tile (the map's box then is too).
  if (T::kVtAhead && !T::kPagedKV) return args.box_rows == T::kBlockN;
  if (first + T::kBlockN > w.end) return false;
  if constexpr (!T::kPagedKV) return true;
  int page_index, in_page;
  page_size.divmod(first, page_index, in_page);
  return in_page == 0 || in_page + T::kBlockN <= int(page_size.divisor);
}

// Decode items (kDecodeItems): an item of at most 64 rows leaves consumer warpgroup 1 without
// rows, so it transposes the item's boxed V tiles in place of the producer, whose chain of
// instructions per tile limits decode. Both roles decide alike, per item; a staging
// buffer is then free once its tile's transposer arrives on v_rows_empty.
template <typename T>
__device__ __forceinline__ bool consumer_transposes(const WorkTile& w) {
  return T::kDecodeItems && w.rows <= 64;
}

// The item's boxed tiles, each of which takes the next fp8 staging buffer, as both roles count them.
template <typename T>
__device__ __forceinline__ int num_boxed_tiles(const KernelArgs<T>& args, const WorkTile& w,
                                               const common::FastDivmod& page_size, int num_tiles) {
  int boxed = 0;
  for (int n = 0; n < num_tiles; ++n) boxed += tile_is_boxed<T>(args, w, page_size, tile_first<T>(w, n));
  return boxed;
}

}  // namespace attnforge::fa3
