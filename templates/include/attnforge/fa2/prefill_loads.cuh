// Role: the FA2 prefill kernel's global -> shared copies: the paged KV row-offset table
//   (fill_kv_offsets), one K or V tile by cp.async (load_kv_tile), the Q tile (load_q_tile,
//   rotated on the way with RoPE), and the RoPE of a landed K tile (rope_k_tile: in place, or an fp8
//   tile into its fp16 copy).
//
// Contract:
//   - Tiles land 128B-XOR-swizzled (common::Swizzle128) in PrefillTraits' layout. K/V rows at or
//     past `end`, and Q rows past the request, are zeros, so the MMAs never meet garbage.
//   - A page id outside [0, num_pages) is never dereferenced: its rows read page 0 and the caller's
//     `bad_page` is raised.
//   - These functions only issue copies (or, for RoPE, plain loads and stores); the caller commits,
//     waits and places the barriers around them.
//
// Must not: wait on copies, synchronize the CTA, or choose which tiles to load.
#pragma once

#include <cstdint>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/rope.cuh"
#include "../common/swizzle.cuh"
#include "../common/vec.cuh"

#include "prefill_traits.cuh"
#include "prefill_state.cuh"

namespace attnforge::fa2 {

// Paged KV: each thread writes the global byte offsets (past the head) of tile rows threadIdx.x +
// i * kThreads into the tile's table in shared memory, 0 past `end` (the copies zero-fill those
// rows but still need an address), so each page id is read once per tile, not once per 16-byte copy
// of K and again of V. Bytes, not elements: a copy's address is then one 64-bit add. A bad page id
// reads page 0 and raises `bad_page`.
template <typename T>
__device__ __forceinline__ void fill_kv_offsets(int64_t* table, const typename T::Params& p, const int32_t* page_ids,
                                                const common::FastDivmod& page_size, int first, int end,
                                                bool& bad_page) {
#pragma unroll
  for (int i = 0; i < (T::kTileKV + T::kThreads - 1) / T::kThreads; ++i) {
    const int row = threadIdx.x + i * T::kThreads;
    if (row >= T::kTileKV) return;
    int64_t offset = 0;
    if (first + row < end) {
      int page_index, in_page;
      page_size.divmod(first + row, page_index, in_page);
      const int page = __ldg(page_ids + page_index);
      const bool ok = static_cast<unsigned>(page) < static_cast<unsigned>(p.num_pages);
      bad_page |= !ok;
      offset = ((ok ? int64_t(page) : int64_t(0)) * p.kv_stride_page + int64_t(in_page) * p.kv_stride_token) *
               int64_t(sizeof(typename T::DTypeKV));
    }
    table[row] = offset;
  }
}

// Issue the cp.async copies of one K or V tile (kTileKV rows of kCells 16-byte cells of the cache,
// request tokens [first, first + kTileKV)); rows at or past `end` are zero-filled so P.V never meets
// garbage.
// Row offsets come from the paged table (K and V pages share their strides), or straight from the
// token for ragged KV, where K and V each have their own token stride.
// Each thread keeps one cell column and walks the rows kRowsPerPass apart, so a copy costs a pointer
// step and a compare: recomputing (row, cell) and a 64-bit row offset per copy made the tile loads
// the largest instruction stream of the loop. With kRowsPerPass % 8 == 0 (head dims 64, 128) the
// swizzled cell is the same for all of a thread's rows, and their shared addresses immediate
// offsets from the first. Head dim 192 leaves kThreads % kCells
// threads idle.
template <typename T, int kCells>
__device__ __forceinline__ void load_kv_tile(typename T::DTypeKV* dst, const typename T::DTypeKV* head_base,
                                             int64_t token_stride, const int64_t* table, int kv_token_base,
                                             int first, int end) {
  constexpr int kRowsPerPass = T::kThreads / kCells;
  constexpr int kPasses = (T::kTileKV + kRowsPerPass - 1) / kRowsPerPass;
  const int row0 = threadIdx.x / kCells, cell = threadIdx.x % kCells;
  if (T::kThreads % kCells != 0 && row0 >= kRowsPerPass) return;
  using Swizzle = common::Swizzle128<common::swizzle_row_cells(kCells)>;
  const uint32_t dst_tile = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const uint32_t dst0 = dst_tile + 16u * Swizzle::cell(row0, cell);
  const typename T::DTypeKV* src = head_base + cell * T::kKVPerCell;
  if constexpr (!T::kPagedKV) src += int64_t(kv_token_base + first + row0) * token_stride;
  const int64_t step = kRowsPerPass * token_stride;
  const int rows_left = end - first - row0;  // rows row0 + i * kRowsPerPass below this are in range
  // Paged: read the thread's table entries before the first copy; interleaving shared-memory loads
  // with cp.async makes ptxas pad every copy with no-ops.
  int64_t offsets[T::kPagedKV ? kPasses : 1];
  if constexpr (T::kPagedKV) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = row0 + i * kRowsPerPass;
      offsets[i] = T::kTileKV % kRowsPerPass == 0 || row < T::kTileKV ? table[row] : 0;
    }
  }
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int row = row0 + i * kRowsPerPass;
    if (T::kTileKV % kRowsPerPass != 0 && row >= T::kTileKV) break;
    const bool valid = i * kRowsPerPass < rows_left;
    const typename T::DTypeKV* row_src;
    if constexpr (T::kPagedKV) {
      row_src = reinterpret_cast<const typename T::DTypeKV*>(reinterpret_cast<const char*>(src) + offsets[i]);
    } else {
      row_src = valid ? src : head_base;
      src += step;
    }
    // kRowsPerPass % 8 == 0: the rows share their swizzled cell, so a row is an immediate offset.
    const uint32_t dst_row = kRowsPerPass % 8 == 0 ? dst0 + 16u * Swizzle::kCellsPerRow * (row - row0)
                                                   : dst_tile + 16u * Swizzle::cell(row, cell);
    common::cp_async_16(dst_row, row_src, valid);
  }
}

// Rotate the landed K tile (RoPE at each key's position) into the tile compute_scores reads: in
// place for a 16-bit cache; for an fp8 one, widened into the fp16 tile k16 (T::kRotatedK16, scaled
// by T::kRotatedKScale), so fp8 K is rounded once, to fp16, after an exact widening and an fp32
// rotation. Each thread takes one 8-element group of the first half of a row and its partner half a
// head dim away. Callers fence around it.
template <typename T>
__device__ __forceinline__ void rope_k_tile(typename T::Tiles& tiles, int first, float rcp_scale, float rcp_theta) {
  using Out = common::Vec16<typename T::DTypeKScores>;
  constexpr int kHalf = T::kHeadDimQK / 16;  // 8-element groups in half a row
  typename T::DTypeKScores* out;
  if constexpr (T::kRotatedK16) {
    out = tiles.k16;
  } else {
    out = tiles.k;
  }
  // The group's address in the cache's tile (8 elements: a 16-bit cell, or half an fp8 cell).
  auto group_ptr = [&](int row, int group) {
    constexpr int kGroupsPerCell = T::kKVPerCell / 8;
    return tiles.k + common::Swizzle128<T::kRowCellsQK>::cell(row, group / kGroupsPerCell) * T::kKVPerCell +
           group % kGroupsPerCell * 8;
  };
  for (int idx = threadIdx.x; idx < T::kTileKV * kHalf; idx += T::kThreads) {
    const int row = idx / kHalf, group = idx % kHalf;
    float lo[8], hi[8];
    common::load_float8(group_ptr(row, group), lo);
    common::load_float8(group_ptr(row, group + kHalf), hi);
    common::rope_rotate<T::kHeadDimQK>(lo, hi, first + row, group * 8, rcp_scale, rcp_theta);
    if constexpr (T::kRotatedKScale != 1.f) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        lo[e] *= T::kRotatedKScale;
        hi[e] *= T::kRotatedKScale;
      }
    }
    *reinterpret_cast<uint4*>(out + common::Swizzle128<T::kRowCellsKScores>::cell(row, group) * 8) = Out::from_float(lo);
    *reinterpret_cast<uint4*>(out + common::Swizzle128<T::kRowCellsKScores>::cell(row, group + kHalf) * 8) =
        Out::from_float(hi);
  }
}

// Load the CTA's Q tile (packed rows) into shared memory; rows past the request are zeros. With
// RoPE the rows are rotated on the way (plain loads), otherwise copied by cp.async.
template <typename T>
__device__ __forceinline__ void load_q_tile(typename T::DTypeQ* dst, const typename T::Params& p, const PrefillRows& rows,
                                            const common::FastDivmod& group, int kv_head) {
  using DTypeQ = typename T::DTypeQ;
  constexpr int kCells = T::kCellsQK;
  using Swizzle = common::Swizzle128<T::kRowCellsQ>;  // rows padded to whole 128-byte lines
  auto row_ptr = [&](int row) -> const DTypeQ* {
    int token, head_in_group;
    group.divmod(rows.row_begin + row, token, head_in_group);
    return static_cast<const DTypeQ*>(p.q) + int64_t(rows.qo_begin + token) * p.q_stride_n +
           int64_t(kv_head * p.group_size + head_in_group) * p.q_stride_h;
  };
  if constexpr (T::kPosEncoding == kPosRopeLlama) {
    using Vec = common::Vec16<DTypeQ>;
    constexpr int kHalf = kCells / 2;
    for (int idx = threadIdx.x; idx < T::kCtaTileQ * kHalf; idx += T::kThreads) {
      const int row = idx / kHalf, cell = idx % kHalf;
      float lo[8] = {}, hi[8] = {};
      if (row < rows.rows) {
        const DTypeQ* src = row_ptr(row);
        Vec::to_float(*reinterpret_cast<const uint4*>(src + cell * 8), lo);
        Vec::to_float(*reinterpret_cast<const uint4*>(src + (cell + kHalf) * 8), hi);
        const int token = group.div(rows.row_begin + row);
        common::rope_rotate<T::kHeadDimQK>(lo, hi, token + rows.pos_shift, cell * 8, p.rope_rcp_scale, p.rope_rcp_theta);
      }
      *reinterpret_cast<uint4*>(dst + Swizzle::cell(row, cell) * 8) = Vec::from_float(lo);
      *reinterpret_cast<uint4*>(dst + Swizzle::cell(row, cell + kHalf) * 8) = Vec::from_float(hi);
    }
  } else {
    for (int idx = threadIdx.x; idx < T::kCtaTileQ * kCells; idx += T::kThreads) {
      const int row = idx / kCells, cell = idx % kCells;
      const bool valid = row < rows.rows;
      const DTypeQ* src = valid ? row_ptr(row) + cell * 8 : static_cast<const DTypeQ*>(p.q);
      common::cp_async_16(dst + Swizzle::cell(row, cell) * 8, src, valid);
    }
  }
}

}  // namespace attnforge::fa2
