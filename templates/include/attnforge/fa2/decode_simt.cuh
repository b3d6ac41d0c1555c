// Role: the FA2 decode kernel's CUDA-core tile (DecodeTraits without kMmaTile): the query it starts
//   from (load_query, pack_query), one KV tile's dot products, reduce-scatter, online-softmax update
//   and P.V for one lane group (decode_tile), and the per-head state the kernel merges token lanes
//   with (SoftmaxState, used by both tiles).
//
// Contract:
//   - Thread (tx, ty, tz): tx owns kCellsPerLane cells of kVec consecutive elements of the head dim
//     (one 16-byte vector of the KV cache: 8 bf16/fp16 or 16 fp8 elements; cells tx + c x kBdx, two
//     at 16-bit hd 512, else one), kLaneDim elements in all; ty a group of kHeadsPerThread query
//     heads, tz a token lane that takes every kBdz-th row of a KV tile.
//   - The kBdx lanes of a row (a lane group) reduce-scatter their partial dot products so that each
//     finished score lives in one lane (ScoreOwner), which applies soft cap, mask and exp2 once; the
//     probabilities reach every lane of the group for P.V through LaneGroupRows in shared memory.
//   - q's slot h holds head h ^ owner.head (the reduce-scatter's order); o holds the heads in
//     natural order. A finished score is a base-2 logit: q is pre-scaled (the packed math multiplies
//     by q.unscale).
//   - An fp8 cache is converted on load to fp16 (exact); with a bf16 output it is multiplied in
//     packed half2 (PackedQuery), else in fp32.
//   - Position encodings (kPosEncoding, FlashInfer's semantics; the query sits at position
//     kv_len - 1 of its request, key row j at j): RoPE rotates q once as it is loaded and each K
//     cell as a lane reads it from the ring, in fp32 by common::rope_rotate, the 8-element group
//     half a head dim away read from the same row; ALiBi adds slope * (j - query) to each finished
//     score, before the soft cap, in the scores' units.
//
// Must not: copy KV tiles, synchronize beyond the warp, or store results: the kernel owns the ring,
//   the lane merge and the stores.
#pragma once

#include <cstdint>

#include "../common/math.cuh"
#include "../common/rope.cuh"
#include "../common/vec.cuh"

#include "decode_traits.cuh"
#include "pos_encoding.cuh"

namespace attnforge::fa2 {

// Online-softmax state of one query head, as seen by one thread (kVec output columns).
template <int kVec>
struct SoftmaxState {
  float m = common::kNegInf;  // running max of base-2 scores
  float d = 0.f;              // running sum of 2^(s - m)
  float o[kVec] = {};         // running sum of 2^(s - m) * v

  // Fold another state (same head, other tokens) into this one.
  __device__ __forceinline__ void merge(float m_other, float d_other, const float* o_other) {
    const float m_new = fmaxf(m, m_other);
    if (m_new == common::kNegInf) return;
    const float a = common::fast_exp2(m - m_new);
    const float b = common::fast_exp2(m_other - m_new);
    d = d * a + d_other * b;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = o[e] * a + o_other[e] * b;
    m = m_new;
  }
};

// Cell c of a lane's kLaneDim elements (row columns lane_col(tx, c) ..): kVec of them.
template <typename T, typename E>
__device__ __forceinline__ auto& lane_cell(E (&x)[T::kLaneDim], int c) {
  return *reinterpret_cast<E(*)[T::kVec]>(&x[c * T::kVec]);
}

// The scores a lane finishes after the reduce-scatter: tokens [token, token + kScoresPerLane) of
// the tile's kTokensPerLane (this lane group's rows) for head slot `head` of kHeadsPerThread.
// The lane computes its partial dot products in an order permuted by the same index (slot (h, j)
// holds head h ^ head, token j ^ token), as lane_group_reduce_scatter requires.
struct ScoreOwner {
  int head;
  int token;
};

template <typename T>
__device__ __forceinline__ ScoreOwner score_owner(int tx) {
  const int own = tx / T::kReplicas * T::kScoresPerLane;
  return {own / T::kTokensPerLane, own % T::kTokensPerLane};
}

// Where a KV tile sits in its request, for the position encodings (unused without one).
struct DecodePositions {
  int tile_first;  // request position of the tile's row 0
  int query;       // the query's position: kv_len - 1
  float alibi;     // ALiBi: the owned head's slope in score units (base 2, over the cap with a soft cap)
  float rope_rcp_scale, rope_rcp_theta;
};

// RoPE of this lane's kVec columns x = row[first, first + kVec) at position pos: each 8-element
// group rotates with the group half a head dim away, read (fp32) from the same row. A padding
// lane (first >= kHeadDim) is left as it is: its q is zero.
template <typename T, typename E>
__device__ __forceinline__ void rope_cell(const E* row, int first, int pos, const DecodePositions& at,
                                          float (&x)[T::kVec]) {
  constexpr int kHalf = T::kHeadDim / 2;
  if (first >= T::kHeadDim) return;
#pragma unroll
  for (int g = 0; g < T::kVec / 8; ++g) {
    const int a = first + 8 * g;
    const bool low = a < kHalf;
    float mine[8], other[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) mine[e] = x[8 * g + e];
    common::load_float8(row + (low ? a + kHalf : a - kHalf), other);
    if (low) {
      common::rope_rotate<T::kHeadDim>(mine, other, pos, a, at.rope_rcp_scale, at.rope_rcp_theta);
    } else {
      common::rope_rotate<T::kHeadDim>(other, mine, pos, a - kHalf, at.rope_rcp_scale, at.rope_rcp_theta);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) x[8 * g + e] = mine[e];
  }
}

// This lane's share of the online softmax outside P.V: running max and the partial denominator
// (over the tokens this lane finished) of its owned head; reduced over kHeadLanes at the end.
struct OwnedHead {
  float m = common::kNegInf;
  float d = 0.f;
};

// The packed math's reduce-scatter (common::lane_group_reduce_scatter's contract): its first step
// adds the partner lane's half2 partial dot products in fp16, each half then summing kVec products
// (within kQueryBound's range), so a lane converts only the kValues / 2 slots it keeps; the other
// steps run in fp32 over the half-size lane group.
template <int kLanes, int kValues>
__device__ __forceinline__ void reduce_scatter_packed(half2 (&dots)[kValues], float (&x)[kValues]) {
  static_assert(kLanes >= 2 && kValues >= 2, "decode scores: the first step needs two lanes and two slots");
  constexpr int kKept = kValues / 2;
  float kept[kKept];
#pragma unroll
  for (int i = 0; i < kKept; ++i) {
    const float2 halves = __half22float2(__hadd2(dots[i], __shfl_xor_sync(0xffffffffu, dots[i + kKept], kLanes / 2)));
    kept[i] = halves.x + halves.y;
  }
  common::lane_group_reduce_scatter<kLanes / 2, kKept>(kept);
#pragma unroll
  for (int i = 0; i < kKept; ++i) x[i] = kept[i];
}

// One KV tile for this lane group: reduce-scattered scores, the online-softmax update, P.V.
// q (fp32) is pre-scaled so a dot product is already a base-2 logit; its slot h holds head h ^ owner.head.
// o holds the heads in natural order. probs is this lane group's shared buffer.
template <typename T>
__device__ __forceinline__ void decode_tile(const typename T::DTypeKV* k_tile, const typename T::DTypeKV* v_tile,
                                            const typename T::Query& q, ScoreOwner owner, const DecodePositions& at,
                                            int valid_rows, float post_scale, typename T::LaneGroupRows& rows,
                                            OwnedHead& own, float (&o)[T::kHeadsPerThread][T::kLaneDim]) {
  using Vec = common::Vec16<typename T::DTypeKV>;
  constexpr int H = T::kHeadsPerThread;
  constexpr int kTokens = T::kTokensPerLane;
  const int tx = threadIdx.x, tz = threadIdx.z;
  // Token j of this lane group is tile row j * kBdz + tz: neighbouring warps read neighbouring rows.
  const int lane_offset = tz * T::kRowDim + tx * T::kVec;  // of its cell 0; cell c is c x kBdx x kVec further
  constexpr int kCellStride = T::kBdx * T::kVec;
  constexpr int kTokenStride = T::kBdz * T::kRowDim;

  float s[T::kScores];  // slot (h, j) at h * kTokens + j
  half2 dots[T::kPackedMath ? T::kScores : 1];  // packed math: the slots' even and odd columns
#pragma unroll
  for (int j = 0; j < kTokens; ++j) {
    const typename T::DTypeKV* k_row = k_tile + (j ^ owner.token) * kTokenStride + lane_offset;
    if constexpr (T::kPackedMath) {
      half2 kh[T::kLaneDim / 2];
#pragma unroll
      for (int c = 0; c < T::kCellsPerLane; ++c) {
        Vec::to_half2(*reinterpret_cast<const uint4*>(k_row + c * kCellStride),
                      *reinterpret_cast<half2(*)[T::kVec / 2]>(&kh[c * T::kVec / 2]));
      }
#pragma unroll
      for (int h = 0; h < H; ++h) {
        half2 dot = __hmul2(q.q[h][0], kh[0]);
#pragma unroll
        for (int e = 1; e < T::kLaneDim / 2; ++e) dot = __hfma2(q.q[h][e], kh[e], dot);
        dots[h * kTokens + j] = dot;
      }
    } else {
      float kf[T::kLaneDim];
#pragma unroll
      for (int c = 0; c < T::kCellsPerLane; ++c) {
        Vec::to_float(*reinterpret_cast<const uint4*>(k_row + c * kCellStride), lane_cell<T>(kf, c));
        if constexpr (T::kRope) {
          const int row = (j ^ owner.token) * T::kBdz + tz;
          rope_cell<T>(k_tile + row * T::kRowDim, T::lane_col(tx, c), at.tile_first + row, at, lane_cell<T>(kf, c));
        }
      }
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < T::kLaneDim; ++e) dot = fmaf(q[h][e], kf[e], dot);
        s[h * kTokens + j] = dot;
      }
    }
  }
  if constexpr (T::kPackedMath) {
    reduce_scatter_packed<T::kBdx, T::kScores>(dots, s);
  } else {
    common::lane_group_reduce_scatter<T::kBdx, T::kScores>(s);
  }

  float tile_max = common::kNegInf;
#pragma unroll
  for (int i = 0; i < T::kScoresPerLane; ++i) {
    float score = s[i];
    const int row = (owner.token + i) * T::kBdz + tz;
    if constexpr (T::kPackedMath) score *= q.unscale;
    if constexpr (T::kPosEncoding == kPosAlibi) score += at.alibi * float(at.tile_first + row - at.query);
    if constexpr (T::kSoftCap) score = post_scale * common::fast_tanh(score);
    s[i] = row < valid_rows ? score : common::kNegInf;
    tile_max = fmaxf(tile_max, s[i]);
  }
  tile_max = common::lane_group_max<T::kHeadLanes, T::kReplicas>(tile_max);
  const float m_new = fmaxf(own.m, tile_max);
  // -inf max: nothing valid yet; keep 2^(s - m) finite by measuring from 0 (p is 0 anyway).
  const float m_safe = m_new == common::kNegInf ? 0.f : m_new;
  // Exactly 1 when the max holds, so P.V below can skip the rescale.
  const float alpha = m_new > own.m ? common::fast_exp2(own.m - m_safe) : 1.f;
  own.m = m_new;
  own.d *= alpha;
  // Every lane multiplies every probability of its group into its own columns of V. A lane holds
  // kScoresPerLane of the kScores, so sharing them by shuffles costs kScores SHFL per lane; through
  // shared memory it is kScoresPerLane + 1 stores and kTokens + 1 row loads (one per token and one
  // for the rescale factors), all lanes of a group reading the same address (a broadcast).
#pragma unroll
  for (int i = 0; i < T::kScoresPerLane; ++i) {
    const float prob = common::fast_exp2(s[i] - m_safe);
    own.d += prob;
    if constexpr (T::kPackedMath) {
      rows.probs[owner.token + i].h[owner.head] = __float2half_rn(prob * T::kProbScale);
    } else {
      rows.probs[owner.token + i].h[owner.head] = prob;
    }
  }
  rows.rescale.h[owner.head] = alpha;  // the head's other lanes (and copies) store the same value
  __syncwarp();  // a lane group never spans warps; the next tile's stores wait behind __syncthreads

  // The max rarely moves after the first tiles: one warp-wide vote skips the whole rescale.
  if (__any_sync(0xffffffffu, alpha != 1.f)) {
    const auto rescale = rows.rescale;
#pragma unroll
    for (int h = 0; h < H; ++h) {
#pragma unroll
      for (int e = 0; e < T::kLaneDim; ++e) o[h][e] *= rescale.h[h];
    }
  }
  if constexpr (T::kPackedMath) {
    // This tile's P.V in fp16, then added into the fp32 o.
    half2 pv[H][T::kLaneDim / 2];
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      half2 vh[T::kLaneDim / 2];
#pragma unroll
      for (int c = 0; c < T::kCellsPerLane; ++c) {
        Vec::to_half2(*reinterpret_cast<const uint4*>(v_tile + j * kTokenStride + lane_offset + c * kCellStride),
                      *reinterpret_cast<half2(*)[T::kVec / 2]>(&vh[c * T::kVec / 2]));
      }
      const typename T::ProbRow p = rows.probs[j];
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const half2 ph = __half2half2(p.h[h]);
#pragma unroll
        for (int e = 0; e < T::kLaneDim / 2; ++e) pv[h][e] = j == 0 ? __hmul2(ph, vh[e]) : __hfma2(ph, vh[e], pv[h][e]);
      }
    }
#pragma unroll
    for (int h = 0; h < H; ++h) {
#pragma unroll
      for (int e = 0; e < T::kLaneDim / 2; ++e) {
        const float2 f = __half22float2(pv[h][e]);
        o[h][2 * e] = fmaf(f.x, 1.f / T::kProbScale, o[h][2 * e]);
        o[h][2 * e + 1] = fmaf(f.y, 1.f / T::kProbScale, o[h][2 * e + 1]);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      float vf[T::kLaneDim];
#pragma unroll
      for (int c = 0; c < T::kCellsPerLane; ++c) {
        Vec::to_float(*reinterpret_cast<const uint4*>(v_tile + j * kTokenStride + lane_offset + c * kCellStride),
                      lane_cell<T>(vf, c));
      }
      const typename T::ProbRow p = rows.probs[j];
#pragma unroll
      for (int h = 0; h < H; ++h) {
#pragma unroll
        for (int e = 0; e < T::kLaneDim; ++e) o[h][e] = fmaf(p.h[h], vf[e], o[h][e]);
      }
    }
  }
}

// This thread's kLaneDim columns of q (cells lane_col(tx, c)), slot h holding head h ^ owner.head of
// the group (zeros on a padding lane, tx >= kCells); with RoPE rotated at the query's position.
template <typename T>
__device__ __forceinline__ void load_query(const typename T::Params& p, int request, int kv_head, int first_slot,
                                           ScoreOwner owner, const DecodePositions& at, int tx,
                                           float (&q)[T::kHeadsPerThread][T::kLaneDim]) {
#pragma unroll
  for (int h = 0; h < T::kHeadsPerThread; ++h) {
    const int qo_head = kv_head * p.group_size + min(first_slot + (h ^ owner.head), p.group_size - 1);
    const auto* q_row = static_cast<const typename T::DTypeQ*>(p.q) + request * p.q_stride_n + qo_head * p.q_stride_h;
    if (tx < T::kCells) {
#pragma unroll
      for (int c = 0; c < T::kCellsPerLane; ++c) {
        common::load_float(q_row + T::lane_col(tx, c), lane_cell<T>(q[h], c));
        if constexpr (T::kRope) rope_cell<T>(q_row, T::lane_col(tx, c), at.query, at, lane_cell<T>(q[h], c));
      }
    } else {
#pragma unroll
      for (int e = 0; e < T::kLaneDim; ++e) q[h][e] = 0.f;  // a padding lane: adds 0 to every score
    }
  }
}

// q as half2 times the largest power of two that keeps the lane group's max |q| within kQueryBound
// (one power for the group, so the finished scores, summed across its lanes, share the unscale).
template <typename T>
__device__ __forceinline__ void pack_query(const float (&qf)[T::kHeadsPerThread][T::kLaneDim], float score_scale,
                                           typename T::Query& q) {
  float max_abs = 0.f;
#pragma unroll
  for (int h = 0; h < T::kHeadsPerThread; ++h) {
#pragma unroll
    for (int e = 0; e < T::kLaneDim; ++e) max_abs = fmaxf(max_abs, fabsf(qf[h][e]));
  }
  const float scale = common::pow2_scale_within(T::kQueryBound, common::lane_group_max<T::kBdx>(max_abs));
  q.unscale = score_scale / scale;
#pragma unroll
  for (int h = 0; h < T::kHeadsPerThread; ++h) {
#pragma unroll
    for (int e = 0; e < T::kLaneDim / 2; ++e) q.q[h][e] = __floats2half2_rn(qf[h][2 * e] * scale, qf[h][2 * e + 1] * scale);
  }
}

}  // namespace attnforge::fa2
