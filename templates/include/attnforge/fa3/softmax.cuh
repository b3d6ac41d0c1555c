// Role: scores to weights: each row's factors (query position, scale), the tile's scores scaled
//   (soft cap) and masked, the online softmax (row max with a lag, exp2, running sum), o's rescale
//   and P converted to the P.V wgmma's A operand.
// Contract: scores live in the base-2 domain: max and sum use s * sm_scale_log2, folded into the
//   exp2 FFMA (soft cap: s = soft_cap_log2 * tanh(s * sm_scale_log2), then a unit scale). A thread
//   holds two rows (r and r + 8) of each wgmma accumulator, shared with its lane quad.
// Must not: touch shared memory or barriers (the keys-along-M form exchanges across warps itself).
#pragma once

#include "mask.cuh"

namespace attnforge::fa3 {

// A wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) viewed as (rows, cols): rows (2, MMA_M),
// cols (2, N/8, MMA_N). A thread's rows are shared with the 3 other lanes of its quad.
template <typename Layout>
__device__ __forceinline__ constexpr auto rowcol(Layout l) {
  using namespace cute;
  static_assert(decltype(rank<0>(l))::value == 3, "fa3: expects an sm90 wgmma accumulator layout");
  auto v = get<0>(l);
  return make_layout(make_layout(get<1>(v), get<1>(l)), make_layout(get<0>(v), get<2>(v), get<2>(l)));
}

// Row `row` of the item: its query position and the factor q.k is scaled by (fp8: times the per-head
// scales).
template <typename T>
__device__ __forceinline__ void row_factors(const typename T::Params& p, const WorkTile& w,
                                            const common::FastDivmod& group, int kv_head, int row, int& q_pos,
                                            float& score_scale) {
  int token, head_in_group;
  group.divmod(w.row_begin + row, token, head_in_group);
  q_pos = token + w.pos_shift;
  score_scale = p.sm_scale_log2;
  if constexpr (T::kFp8) {
    score_scale *= head_scale(p.q_scale, p.q_scale_stride, kv_head * p.group_size + head_in_group) *
                   head_scale(p.k_scale, p.k_scale_stride, kv_head);
  }
}

// Scale (soft cap) and mask one tile of raw scores, s(r, c) the score of the thread's row r and
// its key key_of(r, c) of the tile; `scale` gets the per-row factor the softmax still applies (the
// rows' score_scale, or 1 once the soft cap has applied it).
template <typename T, typename TensorS, typename KeyOf>
__device__ __forceinline__ void transform_scores(const typename T::Params& p, const KeyMask<T>& mask, bool masked,
                                                 int first, int from, const int (&q_pos)[2], const float (&score_scale)[2],
                                                 TensorS& s, KeyOf key_of, float (&scale)[2]) {
  using namespace cute;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    scale[r] = score_scale[r];
    if constexpr (T::kSoftCap) {
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) s(r, c) = p.soft_cap_log2 * common::fast_tanh(s(r, c) * score_scale[r]);
      scale[r] = 1.f;
    }
  }
  if (masked) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) {
        if (!mask.visible(first + key_of(r, c), from, q_pos[r])) s(r, c) = common::kNegInf;
      }
    }
  }
}

// Each of the first kRows rows' max over the tile's columns and its lane quad. Four running
// maxima per row, seeded by the first four columns, the rows in one pass: eight independent FMNMX
// chains for two rows, and their shuffles overlap (one row after the other, ptxas keeps them apart).
template <int kRows, typename TensorS>
__device__ __forceinline__ void first_rows_maxima(const TensorS& s, float (&row_max)[2]) {
  using namespace cute;
  static_assert(decltype(size<1>(s))::value % 4 == 0, "fa3: a row's columns split into four running maxima");
  float part_max[kRows][4];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < 4; ++c) part_max[r][c] = s(r, c);
  }
#pragma unroll
  for (int c = 4; c < size<1>(s); ++c) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) part_max[r][c % 4] = fmaxf(part_max[r][c % 4], s(r, c));
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) row_max[r] = fmaxf(fmaxf(part_max[r][0], part_max[r][1]), fmaxf(part_max[r][2], part_max[r][3]));
#pragma unroll
  for (int r = 0; r < kRows; ++r) row_max[r] = common::lane_group_max<4>(row_max[r]);
}

// The live rows' maxima. Live rows are a prefix (row r + 8 lies past row r), and the test is
// alike in the warp: a decode item's warps skip their dead rows' work, prefill has none.
template <typename TensorS>
__device__ __forceinline__ void row_maxima(const TensorS& s, const bool (&live)[2], float (&row_max)[2]) {
  if (live[1]) {
    first_rows_maxima<2>(s, row_max);
  } else if (live[0]) {
    first_rows_maxima<1>(s, row_max);
  }
}

// Online softmax over one tile of scores (rows x the thread's keys), in place, given the rows'
// maxima over the tile: scores become 2^(s*scale - m), in two steps (move_row_max, then
// exponentiate_scores over the tile's columns or a part of them at a time).
// m is kept in the base-2 scaled domain; d is this thread's partial sum until the final reduce.
// Returns in `alpha` the factor the rows' o must be multiplied by (the caller does it once the
// P.V wgmma still reading o has finished), and in `neg_m` each row's exponent shift.
// `offset` (log2) scales the weights (and so d) by 2^offset; o / d is unchanged.
// m only moves when a tile's max exceeds it by more than `max_lag`: below that the weights stay
// under 2^(offset + max_lag), which P's type holds, and alpha stays exactly 1, so o is rescaled
// only on the few tiles that raise a row's max that far.
// A row that is not `live` (its warp's rows all lie past the item's) is left as it is: its P only
// reaches o rows that are never stored.
__device__ __forceinline__ void move_row_max(const float (&row_max)[2], float (&m)[2], float (&d)[2],
                                             const float (&scale)[2], float offset, float max_lag,
                                             const bool (&live)[2], float (&alpha)[2], float (&neg_m)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    alpha[r] = 1.f;
    if (!live[r]) continue;
    const float scaled_max = row_max[r] * scale[r];
    const float m_new = scaled_max > m[r] + max_lag ? scaled_max : m[r];
    // -inf: nothing visible yet; measure from 0 so 2^(s - m) stays 0 rather than NaN.
    const float m_safe = m_new == common::kNegInf ? 0.f : m_new;
    alpha[r] = m_new == m[r] ? 1.f : common::fast_exp2(m[r] - m_safe);
    m[r] = m_new;
    d[r] *= alpha[r];
    // offset 0 (16-bit) must stay -m_safe: 0 - m is no FNEG (signed zeros), and costs an FADD per row.
    neg_m[r] = offset != 0.f ? offset - m_safe : -m_safe;
  }
}

// The scores of the tile's columns [kBegin, kEnd) as weights 2^(s*scale + neg_m), added to d.
template <int kBegin, int kEnd, typename TensorS>
__device__ __forceinline__ void exponentiate_scores(TensorS& s, const float (&scale)[2], const float (&neg_m)[2],
                                                    const bool (&live)[2], float (&d)[2]) {
  static_assert(decltype(cute::size<0>(s))::value == 2, "fa3: two rows per thread");
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!live[r]) continue;
#pragma unroll
    for (int c = kBegin; c < kEnd; ++c) {
      s(r, c) = common::fast_exp2(fmaf(s(r, c), scale[r], neg_m[r]));
      d[r] += s(r, c);
    }
  }
}

template <typename TensorS>
__device__ __forceinline__ void softmax_rows(TensorS& s, const float (&row_max)[2], float (&m)[2], float (&d)[2],
                                             const float (&scale)[2], float offset, float max_lag,
                                             const bool (&live)[2], float (&alpha)[2]) {
  float neg_m[2];
  move_row_max(row_max, m, d, scale, offset, max_lag, live, alpha, neg_m);
  exponentiate_scores<0, decltype(cute::size<1>(s))::value>(s, scale, neg_m, live, d);
}

template <typename TensorO>
__device__ __forceinline__ void rescale_rows(TensorO& o, const float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int c = 0; c < cute::size<1>(o); ++c) o(r, c) *= alpha[r];
  }
}

// The fp32 accumulator's per-thread order equals the 16-bit A operand's ((2, 2, 2), 1, N/16):
// pairs of columns, row halves, then 8-column blocks. So P is S converted in place, two at a time.
// FP8 packs four per register, row r's two column pairs of two 8-column blocks, then row r + 8's
// (S values 0 1 4 5 | 2 3 6 7 of each 8): the keys p_key_of_slot gives V's rows.
// Part kPart of kParts converts that share of the tile's keys alone (P.V k-blocks kPart K / kParts
// on; S's columns alike, in the rowcol view).
template <typename T, int kPart = 0, int kParts = 1, typename TensorS, typename TensorP>
__device__ __forceinline__ void convert_p(const TensorS& s_acc, TensorP& p_frag, const bool (&live)[2]) {
  static_assert(decltype(cute::size(p_frag))::value == decltype(cute::size(s_acc))::value, "fa3: P and S fragments differ");
  auto words = cute::recast<uint32_t>(p_frag);
  constexpr int kWords = decltype(cute::size(words))::value;
  static_assert(kWords % (2 * kParts) == 0, "fa3: P's parts split its words evenly, in row pairs");
  constexpr int kBegin = kPart * kWords / kParts, kEnd = kBegin + kWords / kParts;
  if constexpr (T::kFp8) {
    auto pack4 = [](float a, float b, float c, float d) {
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
      return lo | (hi << 16);
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // row r's words are the even ones, row r + 8's the odd ones
      if (!live[r]) continue;
#pragma unroll
      for (int i = kBegin + r; i < kEnd; i += 2) {
        const int s = 4 * (i - r) + 2 * r;
        words(i) = pack4(s_acc(s), s_acc(s + 1), s_acc(s + 4), s_acc(s + 5));
      }
    }
  } else {  // no 16-bit kernel has decode items: every row is live
#pragma unroll
    for (int i = kBegin; i < kEnd; ++i) words(i) = common::pack2<typename T::DTypeKV>(s_acc(2 * i), s_acc(2 * i + 1));
  }
}

}  // namespace attnforge::fa3
