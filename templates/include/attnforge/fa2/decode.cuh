// Role: FA2 batch decode over a paged KV cache (one query token per request), on CUDA cores, or
//   on mma.sync tensor cores where 4-8 heads read each element (kMmaTile, decode_mma.cuh).
//
// Contract:
//   grid  = (work_capacity * num_head_tiles, num_kv_heads); block = (kBdx, kBdy, kBdz), 128 threads.
//   A CTA takes one planned work item (request, kv token range [begin, end)) for one kv head and
//   up to kHeadsPerCta of the query heads that share it, so K/V are read once per group.
//   Thread (tx, ty, tz): tx owns kVec consecutive elements of the head dim (one 16-byte vector of
//   the KV cache: 8 bf16/fp16 or 16 fp8 elements; q and o, 16-bit, take kVec / 8 vectors), ty a
//   group of kHeadsPerThread query heads, tz one "token lane" that takes every kBdz-th row of a KV tile.
//   An fp8 cache is converted on load to fp16 (exact); with a bf16 output it is multiplied in packed
//   half2 (PackedQuery, decode_tile), else in fp32. With >= 4 heads per CTA and rows of whole
//   128-byte lines (16-bit hd 64 and 128, fp8 hd 128 and 256) each warp is instead a token lane
//   of 16 consecutive rows that runs MMAs (kMmaTile, decode_tile_mma).
//   Its k_scale folds into score_scale on the host and v_scale multiplies o after the kernel.
//   K/V tiles stream through a kStages-deep cp.async ring. A row's source offset is looked up once
//   per tile, by the row's owner thread, two tiles ahead of its copies (a tile in a register for the
//   page-id load, a tile in shared memory for the copying threads), so the gather never waits on
//   the page table and the kBdx copies of a row do not each repeat the lookup.
//   Scores: the kBdx lanes of a row (a "lane group") reduce-scatter their partial dot products
//   so that each finished score lives in one lane, which applies soft cap, mask and exp2 once;
//   the probabilities reach every lane of the group for P.V through a small shared buffer.
//   Output: softmax-normalized o and base-2 lse (log2 of the denominator plus the scaled max),
//   either straight into o/lse or, for a split request, into the fp32 partial slot the plan gave.
//   An empty range writes o = 0, lse = -inf. A page id outside [0, num_pages) never reaches
//   memory: the CTA reads page 0 instead, writes NaN, and raises the plan's error word.
//
// Must not: decide anything about scheduling (the plan did) or know about dtypes beyond common/vec.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/plan_image.cuh"
#include "../common/vec.cuh"
#include "decode_mma.cuh"

namespace attnforge::fa2 {

// The largest power of two <= x (x > 0), for compile-time fp16 range bounds.
constexpr float pow2_at_most(float x) {
  float p = 1.f;
  while (p > x) p *= 0.5f;
  while (2.f * p <= x) p *= 2.f;
  return p;
}

constexpr float kHalfMax = 65504.f;

// q of one thread for an fp8 cache, as half2 pairs (slot h: head h ^ owner.head, like the fp32 q).
// A 16-bit q times a power of two is exact in fp16; the power is chosen per lane group so that no
// partial dot product over kVec fp8 values can leave fp16's range, and unscale (score_scale over
// that power) turns a finished score into a base-2 logit.
template <int kHeads, int kVec>
struct PackedQuery {
  half2 q[kHeads][kVec / 2];
  float unscale;
};

template <typename Params_, typename DTypeQ_, typename DTypeKV_, typename DTypeO_, int kHeadDim_,
          int kHeadsPerCta_, bool kSoftCap_>
struct DecodeTraits {
  using Params = Params_;
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadsPerCta = kHeadsPerCta_;
  static constexpr bool kSoftCap = kSoftCap_;

  static constexpr int kVec = 16 / sizeof(DTypeKV);  // KV elements per 16-byte load
  static constexpr int kBdx = kHeadDim / kVec;       // threads spanning one KV row
  // A thread serves several heads so that each K/V element it loads and converts feeds all of
  // them: the kernel is issue-bound long before it is bandwidth-bound otherwise. q and o take
  // 2 x kHeadsPerThread x kVec floats; capped at 2 x 32 they stay in registers under the
  // 128-register bound of 4 CTAs per SM: four heads of a 16-bit cache, two of an fp8 one.
  static constexpr int kMaxHeadsPerThread = 32 / kVec;
  static constexpr int kHeadsPerThread = kHeadsPerCta < kMaxHeadsPerThread ? kHeadsPerCta : kMaxHeadsPerThread;
  static constexpr int kBdy = kHeadsPerCta / kHeadsPerThread;  // head groups per CTA
  static constexpr int kThreads = 128;
  static constexpr int kBdz = kThreads / (kBdx * kBdy);  // token lanes
  // Tensor-core tiles (decode_mma.cuh): rows of whole 128-byte lines (16-bit hd 64 and 128, fp8
  // hd 128 and 256) read for 4-8 heads, in 64-token tiles, 16 rows per warp. The CUDA-core tile
  // spends an FMA per head on each element (and an fp8 cache a conversion per head group):
  // issue-bound at 4 and 8 heads (fp8: 695 SASS instructions per tile and warp at 4 heads, 316
  // here). Same-run A/Bs at batch 64 x kv 4096: fp8 hd 128 group 4 148 -> 133 us, group 8 226 ->
  // 136 us; bf16 hd 128 group 8 321 -> 253 us (group 4 unchanged, at the copy bandwidth); bf16 hd
  // 64 group 4 136 -> 132 us, group 8 176 -> 132 us; fp8 hd 256 group 4 267 -> 262 us, group 8
  // 427 -> 268 us. fp8 hd 64 (64-byte rows) keeps the CUDA-core tile, and so does 16-bit hd 256,
  // whose 64-token ring (192 KB) would leave one CTA per SM.
  static constexpr int kWarps = kThreads / 32;
  static constexpr bool kMmaTile =
      kHeadsPerCta >= 4 && kBdx % 8 == 0 && (kHeadDim <= 128 || sizeof(DTypeKV) == 1);
  static constexpr int kMmaChunks = kHeadDim / 16;
  // 8 KB of K and 8 KB of V per stage. 3 stages (48 KB) and <= 128 registers let 4 CTAs share an
  // SM: more warps to hide shuffle and load latency, and ~130 KB of loads in flight per SM
  // (measured: 385 -> 329 us at batch 64 x kv 4096 against 4 stages at 3 CTAs per SM). A 16-bit
  // tensor-core tile takes 16 KB (64 rows) and 2 CTAs per SM: the same bytes in flight.
  static constexpr int kTileTokens = kMmaTile ? 16 * kWarps : 8192 / (kHeadDim * int(sizeof(DTypeKV)));
  static constexpr int kTokensPerLane = kTileTokens / kBdz;
  static constexpr int kStages = 3;
  static constexpr int kMinCtasPerSm = 8192 * 4 / (kTileTokens * kHeadDim * int(sizeof(DTypeKV)));
  static constexpr int kChunksPerTile = kTileTokens * kBdx;  // 16-byte chunks in one K (or V) tile
  static constexpr int kChunksPerThread = kChunksPerTile / kThreads;
  static constexpr int kOffsetSlots = kStages - 1;  // tiles whose row offsets wait in shared memory

  // An fp8 cache spends 1.5 conversions per element to reach fp32 against 2 FMAs of its 2 heads
  // (measured at 61% of copy bandwidth, issue-bound). In fp16 a pair converts in one instruction
  // and feeds packed FMAs directly: q.k partial sums (kVec products a lane) and each tile's P.V
  // (kTokensPerLane products a column) run in half2 and are added into fp32 scores and o.
  // kQueryBound and kProbScale keep those fp16 sums inside fp16's range for any finite fp8 cache.
  // Their rounding (~2^-11 relative per partial sum, ~1e-3 in o and the scores) sits under a bf16
  // output's 2^-9 but not under an fp16 one's 2^-12: an fp16 output keeps the fp32 math (measured:
  // half2 math failed the fp16 reference tolerance of 5e-3).
  static constexpr bool kPackedMath = sizeof(DTypeKV) == 1 && std::is_same_v<DTypeO, __nv_bfloat16>;
  using Query = std::conditional_t<kPackedMath, PackedQuery<kHeadsPerThread, kVec>, float[kHeadsPerThread][kVec]>;
  static constexpr float kMaxKv = [] {
    if constexpr (kPackedMath) return common::Vec16<DTypeKV>::kMaxFinite;
    return 1.f;
  }();
  static constexpr float kQueryBound = pow2_at_most(kHalfMax / (kVec * kMaxKv));
  static constexpr float kProbScale =
      kHalfMax >= kTokensPerLane * kMaxKv ? 1.f : pow2_at_most(kHalfMax / (kTokensPerLane * kMaxKv));

  static_assert(kHeadDim % kVec == 0 && kBdx <= 32 && 32 % kBdx == 0,
                "decode-head-dims: a KV row must span a power-of-two number of lanes within a warp");
  static_assert(kHeadsPerCta % kHeadsPerThread == 0, "decode heads: head groups must tile the CTA's heads");
  static_assert(kBdz >= 1 && kBdx * kBdy * kBdz == kThreads, "decode block: lanes must tile 128 threads");
  static_assert(kChunksPerThread >= 1 && kChunksPerTile % kThreads == 0,
                "decode tile: every thread must issue the same number of 16-byte copies");
  static_assert(kTileTokens % kBdz == 0, "decode tile: token lanes must split a tile evenly");
  static_assert(kTileTokens <= kThreads && kStages >= 3, "decode ring: a thread per tile row owns its offset");
  static_assert(!kMmaTile || kHeadsPerCta <= 8, "decode mma tile: the CTA's heads are the MMAs' 8 columns");

  // Per tile a lane group computes kScores = kTokensPerLane x kHeadsPerThread dot products. The
  // reduce-scatter spreads them over kScatterLanes lanes, kScoresPerLane consecutive tokens of one
  // head each; the remaining kReplicas-fold lanes hold copies. kHeadLanes scatter lanes share a
  // head: its tile max and denominator are reduced over them alone. (Scattering kBdx tokens of
  // each head instead would need 4x larger tiles, which the 3-stage ring at 4 CTAs/SM cannot hold.)
  static constexpr int kScores = kTokensPerLane * kHeadsPerThread;
  static constexpr int kScatterLanes = kScores < kBdx ? kScores : kBdx;
  static constexpr int kScoresPerLane = kScores / kScatterLanes;
  static constexpr int kReplicas = kBdx / kScatterLanes;
  static constexpr int kHeadLanes = kTokensPerLane / kScoresPerLane;
  static_assert(kHeadLanes >= 1 && kTokensPerLane % kScoresPerLane == 0,
                "decode scores: the scores one lane finishes must belong to one head");

  // Token-lane partial states, merged once the KV ring has drained: [lane][kHeadsPerCta][kHeadDim]
  // and (m, d), one lane per tz, or per warp on the tensor-core tile (where fp8 hd 256 at 8 heads
  // has 2 tz for 4 warps). They reuse the ring's memory, which keeps the CTA near 48 KB (4 per SM).
  static constexpr int kStateLanes = kMmaTile && kWarps > kBdz ? kWarps : kBdz;
  static_assert(!kMmaTile || kStateLanes >= kWarps, "decode mma tile: a token-lane state per warp (share_mma_state)");
  struct LaneStates {
    float o[kStateLanes][kHeadsPerCta][kHeadDim];
    float m[kStateLanes][kHeadsPerCta];
    float d[kStateLanes][kHeadsPerCta];
  };
  struct Ring {
    alignas(16) DTypeKV k[kStages][kTileTokens * kHeadDim];
    alignas(16) DTypeKV v[kStages][kTileTokens * kHeadDim];
  };
  // A lane group's per-tile exchange: each token's probabilities for its heads (the packed math's
  // in fp16, times kProbScale, as its P.V multiplies them) and each head's rescale factor. A row
  // is aligned so a lane reads it in one load.
  template <typename E>
  struct alignas(sizeof(E) * kHeadsPerThread) HeadRow {
    E h[kHeadsPerThread];
  };
  using ProbRow = HeadRow<std::conditional_t<kPackedMath, half, float>>;
  struct LaneGroupRows {
    ProbRow probs[kTokensPerLane];
    HeadRow<float> rescale;
  };
  // Ring row `row`'s 16-byte cell `cell`, in elements: swizzled where ldmatrix reads the rows.
  __device__ __forceinline__ static int ring_element(int row, int cell) {
    if constexpr (kMmaTile) return common::Swizzle128<kBdx>::cell(row, cell) * kVec;
    return (row * kBdx + cell) * kVec;
  }
  struct SharedStorage {
    union {
      Ring ring;
      LaneStates lanes;
    };
    LaneGroupRows rows[kBdz][kBdy];  // per lane group, rewritten every tile
    alignas(16) uint32_t mma_probs[kMmaTile ? kWarps : 0][32][4];  // per warp: P's two terms, 16 rows of 8 each
    int64_t row_offsets[kOffsetSlots][kTileTokens];  // tile t's in slot t % kOffsetSlots
  };
};

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
                                            const typename T::Query& q, ScoreOwner owner,
                                            int valid_rows, float post_scale, typename T::LaneGroupRows& rows,
                                            OwnedHead& own, float (&o)[T::kHeadsPerThread][T::kVec]) {
  using Vec = common::Vec16<typename T::DTypeKV>;
  constexpr int H = T::kHeadsPerThread;
  constexpr int kTokens = T::kTokensPerLane;
  const int tx = threadIdx.x, tz = threadIdx.z;
  // Token j of this lane group is tile row j * kBdz + tz: neighbouring warps read neighbouring rows.
  const int lane_offset = tz * T::kHeadDim + tx * T::kVec;
  constexpr int kTokenStride = T::kBdz * T::kHeadDim;

  float s[T::kScores];  // slot (h, j) at h * kTokens + j
  half2 dots[T::kPackedMath ? T::kScores : 1];  // packed math: the slots' even and odd columns
#pragma unroll
  for (int j = 0; j < kTokens; ++j) {
    const uint4& k_raw = *reinterpret_cast<const uint4*>(k_tile + (j ^ owner.token) * kTokenStride + lane_offset);
    if constexpr (T::kPackedMath) {
      half2 kh[T::kVec / 2];
      Vec::to_half2(k_raw, kh);
#pragma unroll
      for (int h = 0; h < H; ++h) {
        half2 dot = __hmul2(q.q[h][0], kh[0]);
#pragma unroll
        for (int e = 1; e < T::kVec / 2; ++e) dot = __hfma2(q.q[h][e], kh[e], dot);
        dots[h * kTokens + j] = dot;
      }
    } else {
      float kf[T::kVec];
      Vec::to_float(k_raw, kf);
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < T::kVec; ++e) dot = fmaf(q[h][e], kf[e], dot);
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
    if constexpr (T::kPackedMath) score *= q.unscale;
    if constexpr (T::kSoftCap) score = post_scale * common::fast_tanh(score);
    s[i] = (owner.token + i) * T::kBdz + tz < valid_rows ? score : common::kNegInf;
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
      for (int e = 0; e < T::kVec; ++e) o[h][e] *= rescale.h[h];
    }
  }
  if constexpr (T::kPackedMath) {
    // This tile's P.V in fp16, then added into the fp32 o.
    half2 pv[H][T::kVec / 2];
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      half2 vh[T::kVec / 2];
      Vec::to_half2(*reinterpret_cast<const uint4*>(v_tile + j * kTokenStride + lane_offset), vh);
      const typename T::ProbRow p = rows.probs[j];
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const half2 ph = __half2half2(p.h[h]);
#pragma unroll
        for (int e = 0; e < T::kVec / 2; ++e) pv[h][e] = j == 0 ? __hmul2(ph, vh[e]) : __hfma2(ph, vh[e], pv[h][e]);
      }
    }
#pragma unroll
    for (int h = 0; h < H; ++h) {
#pragma unroll
      for (int e = 0; e < T::kVec / 2; ++e) {
        const float2 f = __half22float2(pv[h][e]);
        o[h][2 * e] = fmaf(f.x, 1.f / T::kProbScale, o[h][2 * e]);
        o[h][2 * e + 1] = fmaf(f.y, 1.f / T::kProbScale, o[h][2 * e + 1]);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      float vf[T::kVec];
      Vec::to_float(*reinterpret_cast<const uint4*>(v_tile + j * kTokenStride + lane_offset), vf);
      const typename T::ProbRow p = rows.probs[j];
#pragma unroll
      for (int h = 0; h < H; ++h) {
#pragma unroll
        for (int e = 0; e < T::kVec; ++e) o[h][e] = fmaf(p.h[h], vf[e], o[h][e]);
      }
    }
  }
}

// This thread's kVec columns of q, slot h holding head h ^ owner.head of the group.
template <typename T>
__device__ __forceinline__ void load_query(const typename T::Params& p, int request, int kv_head, int first_slot,
                                           ScoreOwner owner, int tx, float (&q)[T::kHeadsPerThread][T::kVec]) {
#pragma unroll
  for (int h = 0; h < T::kHeadsPerThread; ++h) {
    const int qo_head = kv_head * p.group_size + min(first_slot + (h ^ owner.head), p.group_size - 1);
    const auto* q_row = static_cast<const typename T::DTypeQ*>(p.q) + request * p.q_stride_n + qo_head * p.q_stride_h;
    common::load_float(q_row + tx * T::kVec, q[h]);
  }
}

// q as half2 times the largest power of two that keeps the lane group's max |q| within kQueryBound
// (one power for the group, so the finished scores, summed across its lanes, share the unscale).
template <typename T>
__device__ __forceinline__ void pack_query(const float (&qf)[T::kHeadsPerThread][T::kVec], float score_scale,
                                           typename T::Query& q) {
  float max_abs = 0.f;
#pragma unroll
  for (int h = 0; h < T::kHeadsPerThread; ++h) {
#pragma unroll
    for (int e = 0; e < T::kVec; ++e) max_abs = fmaxf(max_abs, fabsf(qf[h][e]));
  }
  const float scale = common::pow2_scale_within(T::kQueryBound, common::lane_group_max<T::kBdx>(max_abs));
  q.unscale = score_scale / scale;
#pragma unroll
  for (int h = 0; h < T::kHeadsPerThread; ++h) {
#pragma unroll
    for (int e = 0; e < T::kVec / 2; ++e) q.q[h][e] = __floats2half2_rn(qf[h][2 * e] * scale, qf[h][2 * e + 1] * scale);
  }
}

template <typename T>
__global__ void __launch_bounds__(T::kThreads, T::kMinCtasPerSm) decode_kernel(const __grid_constant__ typename T::Params p) {
  using DTypeKV = typename T::DTypeKV;
  constexpr int H = T::kHeadsPerThread;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  int32_t* plan = static_cast<int32_t*>(p.plan);

  const int work = blockIdx.x / p.num_head_tiles;
  if (work >= plan[common::kPlanNumWork]) return;  // padding of a static (CUDA-graph) grid
  const int head_tile = blockIdx.x % p.num_head_tiles;
  const int kv_head = blockIdx.y;
  const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
  const int tid = tx + T::kBdx * (ty + T::kBdy * tz);

  const int request = plan[p.off_work_request + work];
  const int begin = plan[p.off_work_begin + work];
  const int end = plan[p.off_work_end + work];
  const int slot = plan[p.off_work_partial + work];
  const int32_t* page_ids = static_cast<const int32_t*>(p.indices) + plan[p.off_indptr + request];

  // This thread's heads (for the stores): group slots head_tile * kHeadsPerCta + ty * H + h. Slots
  // past the group (a tile that does not divide it) compute on a clamped head and store nothing.
  const int cta_slot = head_tile * T::kHeadsPerCta;
  const int first_slot = cta_slot + ty * H;

  // Each thread copies the same kChunksPerThread chunks of every tile: column tid % kBdx of rows
  // tid / kBdx + c * kRowsPerPass. Thread r < kTileTokens owns row r's offset. Branch-free: a row
  // past the range keeps page 0's address and copies zeros (its validity is recomputed at issue
  // instead of being carried in the offset). Offsets are in bytes so that issuing a copy is one
  // 64-bit add per tensor.
  constexpr int kRowsPerPass = T::kThreads / T::kBdx;
  const int copy_row = tid / T::kBdx;
  const int copy_cell = tid % T::kBdx;
  const int copy_col = copy_cell * T::kVec;
  const bool row_owner = tid < T::kTileTokens;
  const auto* k_src = reinterpret_cast<const char*>(static_cast<const DTypeKV*>(p.k) + kv_head * p.kv_stride_head + copy_col);
  const auto* v_src = reinterpret_cast<const char*>(static_cast<const DTypeKV*>(p.v) + kv_head * p.kv_stride_head + copy_col);
  const int64_t page_bytes = p.kv_stride_page * int64_t(sizeof(DTypeKV));
  const int64_t token_bytes = p.kv_stride_token * int64_t(sizeof(DTypeKV));
  const common::FastDivmod page_size(p.page_size);
  bool bad_page = false;
  auto row_offset = [&](int tile) -> int64_t {  // of the owned row
    if (!row_owner) return 0;
    const int token = begin + tile * T::kTileTokens + tid;
    const bool in_range = token < end;
    int page_index, in_page;
    page_size.divmod(token, page_index, in_page);
    const int page = in_range ? __ldg(page_ids + page_index) : 0;
    const bool ok = static_cast<unsigned>(page) < static_cast<unsigned>(p.num_pages);
    bad_page |= in_range && !ok;
    return int64_t(ok ? static_cast<unsigned>(page) : 0u) * page_bytes +
           int64_t(static_cast<unsigned>(in_page)) * token_bytes;
  };
  auto share = [&](int tile, int64_t offset) {
    if (row_owner) smem.row_offsets[tile % T::kOffsetSlots][tid] = offset;
  };
  auto issue = [&](int tile) {
    const int stage = tile % T::kStages;
    const int first_token = begin + tile * T::kTileTokens + copy_row;
    const int64_t* shared_offsets = smem.row_offsets[tile % T::kOffsetSlots];
    int64_t offsets[T::kChunksPerThread];
#pragma unroll
    for (int c = 0; c < T::kChunksPerThread; ++c) offsets[c] = shared_offsets[copy_row + c * kRowsPerPass];
#pragma unroll
    for (int c = 0; c < T::kChunksPerThread; ++c) {
      const int row = copy_row + c * kRowsPerPass;
      const bool valid = first_token + c * kRowsPerPass < end;
      const int element = T::ring_element(row, copy_cell);
      common::cp_async_16(&smem.ring.k[stage][element], k_src + offsets[c], valid);
      common::cp_async_16(&smem.ring.v[stage][element], v_src + offsets[c], valid);
    }
  };

  // Prologue: the first kStages - 1 tiles' offsets shared and copied, the next one's shared and
  // the one after that's looked up (the loop's state on entry).
  const int num_tiles = (end - begin + T::kTileTokens - 1) / T::kTileTokens;
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) share(s, row_offset(s));
  __syncthreads();
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < num_tiles) issue(s);
    common::cp_async_commit();
  }
  __syncthreads();  // the slots are read: the next tiles' offsets may take them
  share(T::kStages - 1, row_offset(T::kStages - 1));
  int64_t next_offset = row_offset(T::kStages);

  // The kv loop: tile by tile, the ring refilled and the tile handed to `consume(stage, valid rows)`.
  auto run_tiles = [&](auto&& consume) {
    for (int tile = 0; tile < num_tiles; ++tile) {
      common::cp_async_wait<T::kStages - 2>();
      __syncthreads();
      // The stage refilled here was consumed in the previous iteration, which the barrier closed;
      // the offset slot written here was last read before it too.
      const int ahead = tile + T::kStages - 1;
      if (ahead < num_tiles) issue(ahead);
      common::cp_async_commit();
      share(ahead + 1, next_offset);
      next_offset = row_offset(ahead + 2);
      consume(tile % T::kStages, end - begin - tile * T::kTileTokens);
    }
    common::cp_async_wait<0>();
  };
  // After the kv loop every token lane's state is in smem.lanes, except that the CUDA-core tile's
  // lane 0 keeps its own in `st`; token lane 0's threads then merge the others into st.
  SoftmaxState<T::kVec> st[H];
  constexpr int kFirstMergedLane = T::kMmaTile ? 0 : 1;
  constexpr int kNumLanes = T::kMmaTile ? T::kWarps : T::kBdz;
  if constexpr (T::kMmaTile) {
    const int warp = tid / 32, lane = tid % 32;
    MmaQuery<T::kMmaChunks> q;
    load_query_mma<T>(p, request, kv_head, cta_slot, lane, q);
    MmaState<T::kMmaChunks> lane_state;
    run_tiles([&](int stage, int valid_rows) {
      decode_tile_mma<T>(reinterpret_cast<const uint8_t*>(smem.ring.k[stage]),
                         reinterpret_cast<const uint8_t*>(smem.ring.v[stage]), q, valid_rows, p.post_scale,
                         smem.mma_probs[warp], warp, lane, lane_state);
    });
    __syncthreads();  // every warp is done reading the ring the lane states overwrite
    share_mma_state<T>(lane_state, smem.lanes, warp, lane);
  } else {
    const ScoreOwner owner = score_owner<T>(tx);
    typename T::Query q;  // slot h: head h ^ owner.head (see ScoreOwner)
    if constexpr (T::kPackedMath) {
      float qf[H][T::kVec];
      load_query<T>(p, request, kv_head, first_slot, owner, tx, qf);
      pack_query<T>(qf, p.score_scale, q);
    } else {
      load_query<T>(p, request, kv_head, first_slot, owner, tx, q);
#pragma unroll
      for (int h = 0; h < H; ++h) {
#pragma unroll
        for (int e = 0; e < T::kVec; ++e) q[h][e] *= p.score_scale;
      }
    }
    float o[H][T::kVec] = {};
    OwnedHead own;
    run_tiles([&](int stage, int valid_rows) {
      decode_tile<T>(smem.ring.k[stage], smem.ring.v[stage], q, owner, valid_rows, p.post_scale, smem.rows[tz][ty],
                     own, o);
    });
    // Gather every head's (m, d) into each lane: a head's lanes already share its max; its
    // denominator is split over them.
    own.d = common::lane_group_sum<T::kHeadLanes, T::kReplicas>(own.d);
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const int owner_lane = h * T::kHeadLanes * T::kReplicas;
      st[h].m = __shfl_sync(0xffffffffu, own.m, owner_lane, T::kBdx);
      st[h].d = __shfl_sync(0xffffffffu, own.d, owner_lane, T::kBdx);
#pragma unroll
      for (int e = 0; e < T::kVec; ++e) st[h].o[e] = o[h][e];
    }
    if constexpr (T::kBdz > 1) {
      __syncthreads();  // every lane is done reading the ring the lane states overwrite
#pragma unroll
      for (int h = 0; h < H; ++h) {
#pragma unroll
        for (int e = 0; e < T::kVec; ++e) smem.lanes.o[tz][ty * H + h][tx * T::kVec + e] = st[h].o[e];
        if (tx == 0) {
          smem.lanes.m[tz][ty * H + h] = st[h].m;
          smem.lanes.d[tz][ty * H + h] = st[h].d;
        }
      }
    }
  }

  if constexpr (kNumLanes > kFirstMergedLane) {
    __syncthreads();
    if (tz == 0) {
      for (int lane = kFirstMergedLane; lane < kNumLanes; ++lane) {
#pragma unroll
        for (int h = 0; h < H; ++h) {
          st[h].merge(smem.lanes.m[lane][ty * H + h], smem.lanes.d[lane][ty * H + h],
                      &smem.lanes.o[lane][ty * H + h][tx * T::kVec]);
        }
      }
    }
  }
  bad_page = __syncthreads_or(bad_page);
  if (tz != 0) return;
  if (bad_page && tid == 0) atomicOr(&plan[common::kPlanError], common::kPlanErrorBadPage);

#pragma unroll
  for (int h = 0; h < H; ++h) {
    if (first_slot + h >= p.group_size) break;
    const int qo_head = kv_head * p.group_size + first_slot + h;
    const float inv_d = st[h].d > 0.f ? 1.f / st[h].d : 0.f;
    float out[T::kVec];
#pragma unroll
    for (int e = 0; e < T::kVec; ++e) out[e] = bad_page ? NAN : st[h].o[e] * inv_d;
    const float lse = bad_page ? NAN : (st[h].d > 0.f ? st[h].m + log2f(st[h].d) : common::kNegInf);
    if (slot < 0) {
      auto* o_row = static_cast<typename T::DTypeO*>(p.o) + request * p.o_stride_n + qo_head * p.o_stride_h;
      common::store_float(o_row + tx * T::kVec, out);
      if (p.lse != nullptr && tx == 0) static_cast<float*>(p.lse)[int64_t(request) * p.num_qo_heads + qo_head] = lse;
    } else {
      const int64_t row = int64_t(slot) * p.num_qo_heads + qo_head;
      float* partial = static_cast<float*>(p.tmp_v) + row * T::kHeadDim + tx * T::kVec;
#pragma unroll
      for (int e = 0; e < T::kVec; e += 4) {
        *reinterpret_cast<float4*>(partial + e) = make_float4(out[e], out[e + 1], out[e + 2], out[e + 3]);
      }
      if (tx == 0) static_cast<float*>(p.tmp_s)[row] = lse;
    }
  }
}

template <typename T>
cudaError_t launch_decode(const typename T::Params& p, cudaStream_t stream) {
  constexpr int kSmem = sizeof(typename T::SharedStorage);
  // Above 48 KB the opt-in must be set per device; setting it every launch is cheap and correct
  // for processes that drive several GPUs.
  if constexpr (kSmem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(decode_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(p.work_capacity * p.num_head_tiles, p.num_kv_heads);
  const dim3 block(T::kBdx, T::kBdy, T::kBdz);
  decode_kernel<T><<<grid, block, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t decode_occupancy(int* ctas_per_sm) {
  constexpr int kSmem = sizeof(typename T::SharedStorage);
  if constexpr (kSmem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(decode_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, decode_kernel<T>, T::kThreads, kSmem);
}

}  // namespace attnforge::fa2
