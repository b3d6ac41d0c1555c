// Role: the FA2 decode kernel's compile-time configuration (DecodeTraits): the thread layout
//   (kBdx x kBdy x kBdz), heads per thread, the choice between the CUDA-core and the tensor-core
//   tile, the KV tile and ring depth, the reduce-scatter shape, the packed math's fp16 range bounds
//   (with the PackedQuery it types) and the shared-memory layout.
//
// Contract:
//   - Every size the decode headers use is chosen here, beside the reason for it; the static_asserts
//     reject a composition the codegen rules should have kept out.
//   - Shared memory: a kStages-deep cp.async ring of K and V tiles (swizzled where ldmatrix reads
//     them, ring_element), reused for the token lanes' (m, d, o) states once the kv loop has
//     drained; per lane group a row of probabilities and rescale factors; per warp the tensor-core
//     tile's P buffer (and, in warp pairs, its partial scores); the row offsets of the tiles the
//     ring has yet to copy.
//
// Must not: hold kernel code (ring_element is the one index map the ring's writer and readers share).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/swizzle.cuh"
#include "../common/vec.cuh"

#include "pos_encoding.cuh"

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
// partial dot product over a lane's kVec fp8 values can leave fp16's range, and unscale (score_scale over
// that power) turns a finished score into a base-2 logit.
template <int kHeads, int kVec>
struct PackedQuery {
  half2 q[kHeads][kVec / 2];
  float unscale;
};

template <typename Params_, typename DTypeQ_, typename DTypeKV_, typename DTypeO_, int kHeadDim_,
          int kHeadsPerCta_, bool kSoftCap_, int kPosEncoding_>
struct DecodeTraits {
  using Params = Params_;
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadsPerCta = kHeadsPerCta_;
  static constexpr bool kSoftCap = kSoftCap_;
  static constexpr int kPosEncoding = kPosEncoding_;  // PosEncoding (pos_encoding.cuh)
  static constexpr bool kRope = kPosEncoding == kPosRopeLlama;

  static constexpr int kVec = 16 / sizeof(DTypeKV);  // KV elements per 16-byte load
  // The tile-size choice for the head dim: a row's kCells 16-byte cells span kBdx lanes, the next
  // power of two (the reduce-scatter and the lane merges halve lane groups by shuffles). A head dim
  // between powers of two (80, 96, 112 -> 16 lanes, 160, 192, 224 -> 32 lanes of a 16-bit cache)
  // runs as kRowDim = kBdx x kVec: the extra lanes' copies are zero-filled without reading memory
  // and their q is zero, so they add 0 to every dot product and nothing to memory traffic, and
  // their o columns are never stored (the tensor-core tile may fill them with the neighbouring
  // heads' bytes instead, kLineWindow, and never reads them). Tiles and the ring are sized for kRowDim.
  // A row of more than 32 cells (16-bit hd 512: 64) cannot take a lane per cell, since a lane group
  // must stay inside a warp: each of 32 lanes takes kCellsPerLane cells, kBdx cells apart (cell
  // tx + c x kBdx), so a warp's reads of one cell index stay 512 contiguous bytes (no bank conflict).
  static constexpr int kCells = kHeadDim / kVec;  // 16-byte cells of a real KV row
  static constexpr int kCellsPerLane = kCells > 32 ? kCells / 32 : 1;
  static constexpr int kBdx = [] {
    int lanes = 1;
    while (lanes < kCells / kCellsPerLane) lanes *= 2;
    return lanes;
  }();
  static constexpr int kLaneDim = kCellsPerLane * kVec;  // elements of a row one lane holds
  static constexpr int kRowCells = kBdx * kCellsPerLane;  // cells of a ring row, padding included
  static constexpr int kRowDim = kRowCells * kVec;        // the row in the ring, padding included
  static constexpr bool kPaddedRow = kRowDim != kHeadDim;
  // A thread serves several heads so that each K/V element it loads and converts feeds all of
  // them: the kernel is issue-bound long before it is bandwidth-bound otherwise. q and o take
  // 2 x kHeadsPerThread x kLaneDim floats; capped at 2 x 32 they stay in registers under the
  // 128-register bound of 4 CTAs per SM: four heads of a 16-bit cache, two of an fp8 one or of a
  // 16-bit hd 512 row (16 elements a lane).
  static constexpr int kMaxHeadsPerThread = 32 / kLaneDim;
  static constexpr int kHeadsPerThread = kHeadsPerCta < kMaxHeadsPerThread ? kHeadsPerCta : kMaxHeadsPerThread;
  static constexpr int kBdy = kHeadsPerCta / kHeadsPerThread;  // head groups per CTA
  static constexpr int kThreads = 128;
  static constexpr int kBdz = kThreads / (kBdx * kBdy);  // token lanes
  // Tensor-core tiles (decode_mma.cuh): ring rows of whole 128-byte lines (16-bit hd 64 to 224,
  // fp8 hd 128 and 256) read for 4-8 heads, 16 rows per warp. The CUDA-core tile spends an FMA per
  // head on each element (and an fp8 cache a conversion per head group), so it is issue-bound at 4
  // and 8 heads, which the MMAs remove. fp8 hd 64 (64-byte rows) keeps the CUDA-core tile.
  static constexpr int kWarps = kThreads / 32;
  // A padded 16-bit row (hd 80, 96, 112 in 128 columns; 160, 192, 224 in 256) takes the MMA tile
  // too: its k-steps and O^T chunks are the hd / 16 real ones (kMmaChunks), while on the CUDA-core
  // tile its padding lanes issue every instruction a real lane does. A padded fp8 row keeps the
  // CUDA-core tile: its MMA path splits each lane's K cells by hd / 4 (the whole row).
  // A position encoding keeps the CUDA-core tile: it rotates each K cell (RoPE) and biases each
  // finished score (ALiBi) where it holds them in registers, which the MMA fragments would scatter.
  // So does hd 512 (any cache, more than 32 cells a row).
  // Rows of 512 bytes (256 columns) come in 32-token tiles with warps in pairs (kMmaSplit): a pair
  // takes 16 rows, each warp half of the real chunks of Q.K^T (the pair adds its partial S through
  // shared memory) and of O^T, so every MMA stays a full m16n8k16 and the ring 96 KB (2 CTAs per SM
  // on sm90, 1 on sm80) instead of 192 KB. hd 256 (no padding) keeps the CUDA-core tile, already at
  // the copy bandwidth: the pair tile would leave sm80 one CTA.
  static constexpr bool kMmaTile = kHeadsPerCta >= 4 && (!kPaddedRow || sizeof(DTypeKV) == 2) && kBdx % 8 == 0 &&
                                   kCellsPerLane == 1 &&
                                   (kHeadDim <= 128 || (sizeof(DTypeKV) == 1 && kHeadDim <= 256) ||
                                    (sizeof(DTypeKV) == 2 && kPaddedRow)) &&
                                   kPosEncoding == kPosNone;
  static constexpr int kMmaChunks = kHeadDim / 16;
  static constexpr int kMmaSplit = kMmaTile && kRowDim * int(sizeof(DTypeKV)) > 256 ? 2 : 1;  // warps per 16 rows
  static constexpr int kMmaWarpChunks = kMmaChunks / kMmaSplit;  // 16-dim chunks of one warp (of q, K and O^T)
  static constexpr int kMmaRowBlocks = kWarps / kMmaSplit;  // 16-row blocks of a tile: the token lanes
  // A padded 16-bit row of 128 columns may read the whole 128-byte lines its head slice touches
  // (line_window_lead): 256 bytes hold the slice when kCells + its offset in cells <= kRowCells,
  // which hd 80 and 96 meet at every head. hd 112 meets it at half its heads only and ran 0.4-1%
  // slower with it (docs/tried.md), so it reads its real cells alone.
  static constexpr bool kLineWindow = kMmaTile && kPaddedRow && kMmaSplit == 1 && kHeadDim <= 96;
  // 8 KB of K and 8 KB of V per stage. 3 stages (48 KB) and <= 128 registers let 4 CTAs share an
  // SM: more warps to hide shuffle and load latency, and more loads in flight than 4 stages at 3
  // CTAs per SM. A 16-bit tensor-core tile takes 16 KB (64 rows of 128 columns, or 32 of 256) and 2
  // CTAs per SM: the same bytes in flight, of which only a padded row's real share (kv_tiles.py
  // bounds it from below) is useful; a ring of real-width rows (3 CTAs per SM at hd 80) ran slower.
  static constexpr int kTileTokens = kMmaTile ? 16 * kMmaRowBlocks : 8192 / (kRowDim * int(sizeof(DTypeKV)));
  static constexpr int kTokensPerLane = kTileTokens / kBdz;
  static constexpr int kStages = 3;
  static constexpr int kMinCtasPerSm = 8192 * 4 / (kTileTokens * kRowDim * int(sizeof(DTypeKV)));
  static constexpr int kChunksPerTile = kTileTokens * kRowCells;  // 16-byte chunks in one K (or V) tile
  static constexpr int kChunksPerThread = kChunksPerTile / kThreads;
  static constexpr int kOffsetSlots = kStages - 1;  // tiles whose row offsets wait in shared memory

  // An fp8 cache spends 1.5 conversions per element to reach fp32 against 2 FMAs of its 2 heads
  // (measured at 61% of copy bandwidth, issue-bound). In fp16 a pair converts in one instruction
  // and feeds packed FMAs directly: q.k partial sums (kVec products a lane) and each tile's P.V
  // (kTokensPerLane products a column) run in half2 and are added into fp32 scores and o.
  // kQueryBound and kProbScale keep those fp16 sums inside fp16's range for any finite fp8 cache.
  // Their rounding (~2^-11 relative per partial sum, ~1e-3 in o and the scores) sits under a bf16
  // output's 2^-9 but not under an fp16 one's 2^-12: an fp16 output keeps the fp32 math (half2
  // math fails the fp16 reference tolerance of 5e-3).
  // RoPE keeps the fp32 math: a rotated fp8 key is no longer exact in fp16, and up to sqrt(2) x
  // kMaxKv, past the bound kQueryBound assumes.
  static constexpr bool kPackedMath = sizeof(DTypeKV) == 1 && std::is_same_v<DTypeO, __nv_bfloat16> && !kRope;
  using Query = std::conditional_t<kPackedMath, PackedQuery<kHeadsPerThread, kLaneDim>, float[kHeadsPerThread][kLaneDim]>;
  static constexpr float kMaxKv = [] {
    if constexpr (kPackedMath) return common::Vec16<DTypeKV>::kMaxFinite;
    return 1.f;
  }();
  static constexpr float kQueryBound = pow2_at_most(kHalfMax / (kLaneDim * kMaxKv));
  static constexpr float kProbScale =
      kHalfMax >= kTokensPerLane * kMaxKv ? 1.f : pow2_at_most(kHalfMax / (kTokensPerLane * kMaxKv));

  static_assert(!kRope || kHeadDim % 16 == 0,
                "decode RoPE: each half of the head dim must be whole 8-element groups (rule head-dims-multiple-of-16)");
  static_assert(kHeadDim % kVec == 0 && kBdx <= 32 && (kCellsPerLane == 1 || kCells % 32 == 0),
                "decode-head-dims: a KV row must be whole 16-byte cells on at most 32 lanes, a row wider than 32 "
                "cells a whole number of cells per lane (rule decode-head-dims)");
  static_assert(kHeadsPerCta % kHeadsPerThread == 0, "decode heads: head groups must tile the CTA's heads");
  static_assert(kBdz >= 1 && kBdx * kBdy * kBdz == kThreads, "decode block: lanes must tile 128 threads");
  static_assert(kChunksPerThread >= 1 && kChunksPerTile % kThreads == 0,
                "decode tile: every thread must issue the same number of 16-byte copies");
  static_assert(kTileTokens % kBdz == 0, "decode tile: token lanes must split a tile evenly");
  static_assert(kTileTokens <= kThreads && kStages >= 3, "decode ring: a thread per tile row owns its offset");
  static_assert(!kMmaTile || kHeadsPerCta <= 8, "decode mma tile: the CTA's heads are the MMAs' 8 columns");
  static_assert(!kMmaTile || kHeadDim % 16 == 0, "decode mma tile: the head dim must be whole k-steps of 16 (rule head-dims-multiple-of-16)");
  static_assert(kMmaSplit == 1 || (kMmaSplit == 2 && sizeof(DTypeKV) == 2 && kMmaChunks % 2 == 0),
                "decode mma tile: a warp pair splits a 16-bit row's chunks in two halves (decode_tile_mma)");

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

  // Token-lane partial states, merged once the KV ring has drained: [lane][kHeadsPerCta][kRowDim]
  // and (m, d), one lane per tz, or per 16-row block on the tensor-core tile (where fp8 hd 256 at 8
  // heads has 2 tz for 4 blocks). They reuse the ring's memory, which keeps the CTA near 48 KB (4 per SM).
  // A head's o row holds lane tx's kLaneDim elements at [tx x kLaneDim, ...): its columns in order
  // when a lane has one cell (as the tensor-core tile writes them), lane by lane at hd 512.
  static constexpr int kStateLanes = kMmaTile && kMmaRowBlocks > kBdz ? kMmaRowBlocks : kBdz;
  static_assert(!kMmaTile || kStateLanes >= kMmaRowBlocks,
                "decode mma tile: a token-lane state per 16-row block (share_mma_state)");
  struct LaneStates {
    float o[kStateLanes][kHeadsPerCta][kRowDim];
    float m[kStateLanes][kHeadsPerCta];
    float d[kStateLanes][kHeadsPerCta];
  };
  struct Ring {
    alignas(16) DTypeKV k[kStages][kTileTokens * kRowDim];
    alignas(16) DTypeKV v[kStages][kTileTokens * kRowDim];
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
    return (row * kRowCells + cell) * kVec;
  }
  // The first element of lane tx's cell c (of kCellsPerLane) in a row.
  __device__ __forceinline__ static int lane_col(int tx, int c) { return (tx + c * kBdx) * kVec; }
  struct SharedStorage {
    union {
      Ring ring;
      LaneStates lanes;
    };
    LaneGroupRows rows[kBdz][kBdy];  // per lane group, rewritten every tile
    alignas(16) uint32_t mma_probs[kMmaTile ? kWarps : 0][32][4];  // per warp: P's two terms, 16 rows of 8 each
    float4 mma_scores[kMmaSplit > 1 ? kWarps : 0][32];  // per warp of a pair: its partial S fragments
    int64_t row_offsets[kOffsetSlots][kTileTokens];  // tile t's in slot t % kOffsetSlots
  };
};

}  // namespace attnforge::fa2
