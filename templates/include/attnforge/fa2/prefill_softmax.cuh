// Role: the FA2 prefill kernel's online softmax: the per-tile update of a thread's (m, d, o)
//   (softmax_update) and the column split's merge of the warps' states through shared memory
//   (merge_warp_states).
//
// Contract:
//   - softmax_update turns a tile's scores into probabilities 2^(s * scale - m) in place,
//     rescales d to the new max and returns o's factor (alpha), which accumulate_pv applies
//     before its first MMA into each o chunk (prefill_mma.cuh). The tile's probabilities join d
//     here, each lane its own (the quad reduced after the loop), or with T::kRowSumMma in
//     accumulate_pv, whole rows (each lane of a quad holds its row's full sum). A row that has seen no visible key keeps m = -inf, d = 0,
//     o = 0: exponents are then measured from 0, never from -inf.
//   - merge_warp_states leaves the merged state in warp 0 (kWarpsKV > 1). Its states overwrite the
//     tiles, so every warp must be done with them (the caller's barrier); each d must already be
//     the whole row's (the quad reduced).
//
// Must not: normalize or store o (prefill_epilogue.cuh does), or read global memory.
#pragma once

#include "../common/math.cuh"

#include "prefill_traits.cuh"
#include "prefill_state.cuh"

namespace attnforge::fa2 {

// Online-softmax step: fold the tile's max into m, rescale d, put o's rescale factor for each row in
// alpha, and turn the scores into probabilities 2^(s * scale - m) in place, summed into d here unless
// accumulate_pv does (T::kRowSumMma). o is rescaled by
// accumulate_pv, chunk by chunk beside the MMAs that read it (a separate pass over all of o made
// ptxas shuffle the accumulators between registers). `scale` turns the scores into base-2 units:
// sm_scale_log2 for raw scores, 1 once transform_scores has applied it.
template <typename T>
__device__ __forceinline__ void softmax_update(float (&s)[T::kMmaQ][T::kMmaKV][8], float scale, PrefillState<T>& st,
                                               float (&alpha)[T::kMmaQ][2]) {
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float tile_max = common::kNegInf;
#pragma unroll
      for (int mk = 0; mk < T::kMmaKV; ++mk) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (frag_row_half(e) == rr) tile_max = fmaxf(tile_max, s[mq][mk][e]);
        }
      }
      // The four lanes of a quad share the row.
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(st.m[mq][rr], tile_max * scale);
      // -inf max: nothing visible yet; measure from 0 so 2^(s - m) stays 0 rather than NaN.
      const float m_safe = m_new == common::kNegInf ? 0.f : m_new;
      alpha[mq][rr] = common::fast_exp2(st.m[mq][rr] - m_safe);
      st.m[mq][rr] = m_new;
      st.d[mq][rr] *= alpha[mq][rr];
#pragma unroll
      for (int mk = 0; mk < T::kMmaKV; ++mk) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (frag_row_half(e) == rr) {
            s[mq][mk][e] = common::fast_exp2(fmaf(s[mq][mk][e], scale, -m_safe));
            if constexpr (!T::kRowSumMma) st.d[mq][rr] += s[mq][mk][e];
          }
        }
      }
    }
  }
}

// Column-split variant: fold the other warps' (m, d, o) into warp 0's through shared memory. Every
// warp has finished its last tile (the caller's barrier) before the states overwrite the tiles.
template <typename T>
__device__ __forceinline__ void merge_warp_states(typename T::SharedStorage& smem, int warp_kv, PrefillState<T>& st) {
  const int lane = threadIdx.x % 32;
  auto& ws = smem.states;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = rr * 8 + lane / 4;
#pragma unroll
    for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (frag_row_half(e) == rr) ws.o[warp_kv][row][o_col<T>(dv, e, lane)] = st.o[0][dv][e];
      }
    }
    if (lane % 4 == 0) {
      ws.m[warp_kv][row] = st.m[0][rr];
      ws.d[warp_kv][row] = st.d[0][rr];
    }
  }
  __syncthreads();
  if (warp_kv != 0) return;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = rr * 8 + lane / 4;
    for (int w = 1; w < T::kWarpsKV; ++w) {
      const float m_other = ws.m[w][row];
      const float m_new = fmaxf(st.m[0][rr], m_other);
      if (m_new == common::kNegInf) continue;
      const float a = common::fast_exp2(st.m[0][rr] - m_new);
      const float b = common::fast_exp2(m_other - m_new);
      st.d[0][rr] = st.d[0][rr] * a + ws.d[w][row] * b;
      st.m[0][rr] = m_new;
#pragma unroll
      for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (frag_row_half(e) == rr) st.o[0][dv][e] = st.o[0][dv][e] * a + ws.o[w][row][o_col<T>(dv, e, lane)] * b;
        }
      }
    }
  }
}

}  // namespace attnforge::fa2
