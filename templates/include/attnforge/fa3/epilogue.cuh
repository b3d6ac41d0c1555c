// Role: a job's rows on their way out: normalized by the row sums (fp8: times the v scale) and
//   stored as o (+ lse) or as fp32 partial rows for the split-KV merge.
// Contract: output is o (+ lse, base 2) or, when the item's slot >= 0, fp32 partial rows at slot +
//   token * num_chunks[request]. A row stored to o joins its attention sink (p.sinks,
//   common::with_sink); a partial row does not (the merge joins it). A row that sees no key: o = 0,
//   lse = -inf (before the sink); an item with a bad page id: NaN rows.
// Must not: wait on the pipeline (the caller has finished the job's tiles).
#pragma once

#include "../common/merge.cuh"
#include "traits.cuh"

namespace attnforge::fa3 {

// Within each quad (the four lanes that share a row of a wgmma accumulator), lane i's v[j] moves to
// lane j's v[i]: two butterfly exchanges, lanes 2 apart, then 1 apart.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4]) {
  const bool upper = threadIdx.x & 2, odd = threadIdx.x & 1;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? v[k] : v[k + 2], 2);
    if (upper) v[k] = got; else v[k + 2] = got;
  }
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? v[k] : v[k + 1], 1);
    if (odd) v[k] = got; else v[k + 1] = got;
  }
}

// One accumulator row of o, scaled by inv_d, stored as 16-byte vectors. A lane holds two columns of
// each 8-column block; after a quad transpose per four blocks, lane q holds all of block 4g + q, so
// one warp store writes 64 contiguous bytes of each of its 8 rows: two-column stores (4x the
// instructions) leave every job on a store tail that short jobs feel most. A tile dim that is not
// a multiple of 32 (hd 80, 112) ends in one or two blocks that no quad exchange fills: those go two
// columns a lane.
template <typename DTypeO, typename TensorO, typename TensorC>
__device__ __forceinline__ void store_o_row(DTypeO* o_row, bool stored, float inv_d, int r, TensorO& o,
                                            TensorC& coord, int cols) {
  using namespace cute;
  constexpr int kBlocks = decltype(size<1>(o))::value / 2;  // 8-column blocks
  const int q = threadIdx.x % 4;
#pragma unroll
  for (int g = 0; g < kBlocks / 4; ++g) {
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = common::pack2<DTypeO>(o(r, 8 * g + 2 * i) * inv_d, o(r, 8 * g + 2 * i + 1) * inv_d);
    quad_transpose(v);
    // (r, 8g) is this lane's first column of block 4g: 8 * 4g + 2q
    // Columns from `cols` on are a padded tile dim's (whole 8-column blocks: cols % 16 == 0).
    const int col = get<1>(coord(r, 8 * g)) + 6 * q;
    if (stored && col < cols) *reinterpret_cast<uint4*>(o_row + col) = make_uint4(v[0], v[1], v[2], v[3]);
  }
#pragma unroll
  for (int b = kBlocks / 4 * 4; b < kBlocks; ++b) {
    const int col = get<1>(coord(r, 2 * b));
    if (stored && col < cols) {
      *reinterpret_cast<uint32_t*>(o_row + col) = common::pack2<DTypeO>(o(r, 2 * b) * inv_d, o(r, 2 * b + 1) * inv_d);
    }
  }
}

// A row of the item on its way out: its token and qo head, its normalization (fp8: times the kv
// head's v scale) and lse, and where they go: o's row and lse (w.slot < 0), else the fp32 partial
// row and lse of the chunk.
template <typename T>
struct RowOutput {
  int token, qo_head;
  float inv_d, lse;

  __device__ __forceinline__ typename T::DTypeO* o_row(const typename T::Params& p, const WorkTile& w) const {
    return static_cast<typename T::DTypeO*>(p.o) + int64_t(w.qo_begin + token) * p.o_stride_n +
           int64_t(qo_head) * p.o_stride_h;
  }
  __device__ __forceinline__ float* lse_at(const typename T::Params& p, const WorkTile& w) const {
    return static_cast<float*>(p.lse) + int64_t(w.qo_begin + token) * p.num_qo_heads + qo_head;
  }
  __device__ __forceinline__ int64_t partial_row(const typename T::Params& p, const WorkTile& w, int num_chunks) const {
    return int64_t(w.slot + token * num_chunks) * p.num_qo_heads + qo_head;
  }
};

// What a job's rows share on their way out.
struct ItemOutput {
  int num_chunks;  // the request's (w.slot >= 0)
  float v_scale;
  bool bad_page;
};

template <typename T>
__device__ __forceinline__ ItemOutput item_output(const typename T::Params& p, const WorkTile& w, int kv_head,
                                                  bool bad_page) {
  return {w.slot >= 0 ? static_cast<const int32_t*>(p.plan)[p.off_num_chunks + w.request] : 0,
          T::kFp8 ? head_scale(p.v_scale, p.v_scale_stride, kv_head) : 1.f, bad_page};
}

template <typename T>
__device__ __forceinline__ RowOutput<T> row_output(const typename T::Params& p, const WorkTile& w,
                                                   const common::FastDivmod& group, int kv_head,
                                                   const ItemOutput& item, int row, float m, float d) {
  RowOutput<T> out;
  int head_in_group;
  group.divmod(w.row_begin + row, out.token, head_in_group);
  out.qo_head = kv_head * p.group_size + head_in_group;
  // The approximate division and log2 (MUFU.RCP, MUFU.LG2; d is a sum of weights below 2^9 each,
  // far from __fdividef's 2^126 limit) shorten the store's dependent chain, which short jobs feel.
  // d is 0 exactly when the row saw no key; a NaN d (a NaN key or value read,
  // e.g. the NaN rows a bad page id leaves in pages gathered ahead) stays NaN in o and lse.
  out.inv_d = item.bad_page ? NAN : (d != 0.f ? __fdividef(item.v_scale, d) : 0.f);
  out.lse = item.bad_page ? NAN : (d != 0.f ? m + __log2f(d) - T::kPExponentOffset : common::kNegInf);
  if (w.slot < 0 && p.sinks != nullptr) {  // a split row's sink joins in the merge instead
    const common::SinkJoin joined = common::with_sink(out.lse, static_cast<const float*>(p.sinks)[out.qo_head]);
    out.inv_d *= joined.scale;
    out.lse = joined.lse;
  }
  return out;
}

// Normalize and store the thread's rows: o/lse directly, or the fp32 partial slot of the chunk.
// Every lane runs the quad exchanges, stored rows or not.
template <typename T, typename TensorO, typename TensorC>
__device__ __forceinline__ void store_rows(const typename T::Params& p, const WorkTile& w,
                                           const common::FastDivmod& group, int kv_head, bool bad_page,
                                           const float (&m)[2], const float (&d)[2], TensorO& o, TensorC& coord) {
  using namespace cute;
  const int lane = threadIdx.x % 32;
  const ItemOutput item = item_output<T>(p, w, kv_head, bad_page);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = get<0>(coord(r, 0));
    const bool stored = row < w.rows;
    const RowOutput<T> out = row_output<T>(p, w, group, kv_head, item, row, m[r], d[r]);
    if (w.slot < 0) {
      store_o_row(out.o_row(p, w), stored, out.inv_d, r, o, coord, T::kHeadDimVO);
      if (stored && p.lse != nullptr && lane % 4 == 0) *out.lse_at(p, w) = out.lse;
    } else if (stored) {
      const int64_t prow = out.partial_row(p, w, item.num_chunks);
      float* partial = static_cast<float*>(p.tmp_v) + prow * T::kHeadDimVO;
#pragma unroll
      for (int c = 0; c < size<1>(o); c += 2) {
        const int col = get<1>(coord(r, c));
        if (T::kTileDimVO == T::kHeadDimVO || col < T::kHeadDimVO) {
          *reinterpret_cast<float2*>(partial + col) = make_float2(o(r, c) * out.inv_d, o(r, c + 1) * out.inv_d);
        }
      }
      if (lane % 4 == 0) static_cast<float*>(p.tmp_s)[prow] = out.lse;
    }
  }
}

}  // namespace attnforge::fa3
