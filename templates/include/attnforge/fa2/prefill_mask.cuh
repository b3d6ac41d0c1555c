// Role: the FA2 prefill kernel's score modifiers: each fragment row's coordinates (RowCoords), the
//   scale, ALiBi bias and soft cap of a KV tile's raw scores (transform_scores), and the mask of a
//   tile that straddles a boundary (mask_scores).
//
// Contract:
//   - Scores live in the base-2 domain: s = q.k * sm_scale_log2, or soft_cap_log2 * tanh(.) under a
//     soft cap; the ALiBi bias is added in the same units, before the cap.
//   - Visible: col < end; col <= q_pos (causal) or the custom-mask bit set (custom mask); and
//     col >= q_pos - window_left (sliding window), with q_pos = token + pos_shift (bottom-right
//     aligned). An invisible score becomes -inf.
//   - The kernel calls transform_scores only without kRawScores (otherwise softmax_update applies
//     the scale) and mask_scores only for tiles that straddle a boundary.
//
// Must not: decide which tiles need a mask (the kernel narrows the key range and tests each tile).
#pragma once

#include <cstdint>

#include "../common/math.cuh"

#include "prefill_traits.cuh"
#include "prefill_state.cuh"

namespace attnforge::fa2 {

// What one thread needs to score its fragment elements: per fragment row its token and q position.
template <typename T>
struct RowCoords {
  int token[T::kMmaQ][2];
  float alibi[T::kMmaQ][2];  // ALiBi slope in score units (base 2, before the soft cap)
};

// Scale (score_scale: sm_scale_log2, times prepare_q_for_fp8_kv's factor), bias and cap the raw
// scores of one KV tile whose first column is request token `first` (variants without kRawScores).
template <typename T>
__device__ __forceinline__ void transform_scores(const typename T::Params& p, float score_scale, const PrefillRows& rows,
                                                 const RowCoords<T>& rc, int first, int warp_kv,
                                                 float (&s)[T::kMmaQ][T::kMmaKV][8]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int mk = 0; mk < T::kMmaKV; ++mk) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int rr = frag_row_half(e);
        const int col = first + (warp_kv * T::kMmaKV + mk) * 16 + frag_col(e, lane);
        float x = s[mq][mk][e] * score_scale;
        if constexpr (T::kPosEncoding == kPosAlibi) x += rc.alibi[mq][rr] * float(col - (rc.token[mq][rr] + rows.pos_shift));
        if constexpr (T::kSoftCap) x = p.soft_cap_log2 * common::fast_tanh(x);
        s[mq][mk][e] = x;
      }
    }
  }
}

// Mask the scores of a tile that straddles a boundary (-inf where invisible). Visible: col < end,
// and col <= q_pos (causal), col >= q_pos - window, custom-mask bit set. Other tiles skip this
// whole pass, not a test per element.
template <typename T>
__device__ __forceinline__ void mask_scores(const typename T::Params& p, const PrefillRows& rows,
                                            const RowCoords<T>& rc, int first, int end, int warp_kv,
                                            float (&s)[T::kMmaQ][T::kMmaKV][8]) {
  const int lane = threadIdx.x % 32;
  const uint8_t* mask_bits = nullptr;
  if constexpr (T::kCustomMask) {
    mask_bits = static_cast<const uint8_t*>(p.custom_mask) + static_cast<const int32_t*>(p.plan)[p.off_mask_indptr + rows.request];
  }
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int mk = 0; mk < T::kMmaKV; ++mk) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int rr = frag_row_half(e);
        const int col = first + (warp_kv * T::kMmaKV + mk) * 16 + frag_col(e, lane);
        const int q_pos = rc.token[mq][rr] + rows.pos_shift;
        bool visible = col < end;
        if constexpr (T::kCustomMask) {
          const int64_t bit = int64_t(rc.token[mq][rr]) * rows.kv_len + col;
          visible = visible && rc.token[mq][rr] < rows.qo_len && ((__ldg(mask_bits + (bit >> 3)) >> (bit & 7)) & 1);
        } else {
          visible = visible && (!p.causal || col <= q_pos);
        }
        if constexpr (T::kSlidingWindow) visible = visible && col >= q_pos - p.window_left;
        if (!visible) s[mq][mk][e] = common::kNegInf;
      }
    }
  }
}

}  // namespace attnforge::fa2
