// Role: what one thread of the FA2 prefill kernel knows about its rows: the CTA's row range
//   (PrefillRows), the online-softmax state of its fragment rows (PrefillState), the map from an
//   mma C-fragment element to its row and column (frag_row_half, frag_col, o_col, o_pair_first),
//   (the ALiBi slope is fa2/pos_encoding.cuh's alibi_slope).
//
// Contract:
//   - Packed rows: a request's packed row p is token p / group_size, query head p % group_size of
//     the CTA's kv head, so a token's heads are adjacent rows.
//   - A thread holds fragment rows lane / 4 and lane / 4 + 8 of each of its kMmaQ 16-row blocks;
//     m and d are in the base-2 domain, d being the lane's partial sum until the kernel adds the
//     other three lanes of the row.
//   - o's elements follow V's fragment order: natural for 16-bit V, the even dims then the odd
//     dims of each 16-dim chunk for fp8 V. Whatever reads or writes o by column goes through o_col.
//
// Must not: touch memory: this is registers and index arithmetic.
#pragma once

#include "../common/math.cuh"

#include "prefill_traits.cuh"

namespace attnforge::fa2 {

// Rows of this CTA as the kernel sees them: one request, packed rows [row_begin, row_begin + rows).
struct PrefillRows {
  int request, qo_begin, qo_len, kv_len, row_begin, rows;
  int pos_shift;  // q_pos = token + pos_shift (bottom-right aligned)
};

// Online-softmax state of the rows one thread touches: fragment rows lane / 4 and lane / 4 + 8 of
// each of its kMmaQ row blocks. m, d are in the base-2 domain; d is this lane's partial sum until
// the kernel adds the other three lanes of the row.
template <typename T>
struct PrefillState {
  float o[T::kMmaQ][T::kMmaDVO][8];
  float m[T::kMmaQ][2];
  float d[T::kMmaQ][2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        m[mq][rr] = common::kNegInf;
        d[mq][rr] = 0.f;
      }
#pragma unroll
      for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[mq][dv][e] = 0.f;
      }
    }
  }
};

// Fragment element e of a 16x16 block sits at row (e % 4) / 2 * 8 + lane / 4 and column
// (e / 4) * 8 + 2 * (lane % 4) + e % 2 (two m16n8 C fragments side by side).
__device__ __forceinline__ int frag_row_half(int e) { return (e % 4) / 2; }
__device__ __forceinline__ int frag_col(int e, int lane) { return (e / 4) * 8 + 2 * (lane % 4) + e % 2; }

// The column (dim) of o that element e of o's 16-dim chunk dv holds. 16-bit V: frag_col. fp8 V
// (load_v_fragments): elements 0-3 are the chunk's even dims, 4-7 its odd ones, so lane (g, t)
// holds dims 4t .. 4t + 3 of its two rows.
template <typename T>
__device__ __forceinline__ int o_col(int dv, int e, int lane) {
  if constexpr (T::kFp8KV) return dv * 16 + 4 * (lane % 4) + 2 * (e % 2) + e / 4;
  return dv * 16 + frag_col(e, lane);
}

// Element pairs (first, first + step) of o's chunk that hold two adjacent columns of row half rr
// (pair 0 at the lower columns): (e, e + 1) for 16-bit V, (e, e + 4) for fp8 V.
template <typename T>
__device__ __forceinline__ int o_pair_first(int rr, int pair) {
  return T::kFp8KV ? rr * 2 + pair : pair * 4 + rr * 2;
}
template <typename T>
constexpr int kOPairStep = T::kFp8KV ? 4 : 1;

}  // namespace attnforge::fa2
