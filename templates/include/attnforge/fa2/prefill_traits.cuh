// Role: the FA2 prefill kernel's compile-time configuration (PrefillTraits): dtypes, the tile shape
//   (kCtaTileQ packed q rows by kTileKV keys), the warp split, the copy geometry and the
//   shared-memory layout (the position-encoding tags are fa2/pos_encoding.cuh's).
//
// Contract:
//   - Every size the prefill headers use is chosen here, beside the reason for it; the other
//     headers read these constants and pick none of their own.
//   - The static_asserts reject a composition the codegen rules should have kept out, naming the
//     rule where one exists.
//   - Shared memory: one Q tile, one K tile and one V tile (the CTA's kSliceVO columns of V; and,
//     for RoPE over an fp8 cache, K's rotated fp16 copy), each 128B-XOR-swizzled in rows of whole
//     128-byte lines; the paged row offsets of the current and the next KV tile; and, for the column
//     split (kWarpsKV > 1), the warps' (m, d, o) states, which overwrite the tiles once the last one
//     is consumed. kMinCtasPerSm CTAs must fit one SM.
//   - Head dim 512 splits o's columns over kVOSlices CTAs (grid z): each computes the full Q K^T and
//     softmax but accumulates only its kSliceVO columns of V and o.
//
// Must not: hold device code, or read Params (it only carries the type).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../common/swizzle.cuh"

#include "pos_encoding.cuh"

namespace attnforge::fa2 {

template <typename Params_, typename DTypeQ_, typename DTypeKV_, typename DTypeO_, int kHeadDimQK_, int kHeadDimVO_,
          int kCtaTileQ_, bool kPagedKV_, bool kSoftCap_, bool kSlidingWindow_, bool kCustomMask_, int kPosEncoding_>
struct PrefillTraits {
  using Params = Params_;
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimVO = kHeadDimVO_;
  static constexpr int kCtaTileQ = kCtaTileQ_;
  static constexpr bool kPagedKV = kPagedKV_;
  static constexpr bool kSoftCap = kSoftCap_;
  static constexpr bool kSlidingWindow = kSlidingWindow_;
  static constexpr bool kCustomMask = kCustomMask_;
  static constexpr int kPosEncoding = kPosEncoding_;

  static constexpr bool kFp8KV = sizeof(DTypeKV) == 1;
  // The MMAs' 16-bit type: q's, or fp16 for an fp8 cache (which fp16 holds exactly, one cvt per
  // pair on sm89+; bf16 would take three more instructions per pair, per warp that reads it).
  using DTypeMma = std::conditional_t<kFp8KV, half, DTypeQ>;
  // RoPE over an fp8 cache: each K tile is widened and rotated once, by the CTA, into an fp16 tile
  // that Q.K then reads like a 16-bit cache's (rope_k_tile). Rotating in registers after widening
  // would repeat the sincos of every key in each of the 4 row warps, and dims i and i + d/2 arrive
  // in different k steps; the 16-bit path likewise rotates its K tile once, in place.
  static constexpr bool kRotatedK16 = kFp8KV && kPosEncoding == kPosRopeLlama;
  // The K tile compute_scores reads: the cache's, or the rotated fp16 one.
  using DTypeKScores = std::conditional_t<kRotatedK16, half, DTypeKV>;
  static constexpr bool kFp8KFragments = sizeof(DTypeKScores) == 1;  // K widened in registers
  // A rotated e5m2 pair can exceed fp16's 65504 (|x cos - y sin| <= sqrt(2) x 57344): the fp16 K
  // tile holds it halved, and the score scale doubles (exact: powers of two).
  static constexpr float kRotatedKScale = kRotatedK16 && std::is_same_v<DTypeKV, __nv_fp8_e5m2> ? 0.5f : 1.f;
  static_assert(std::is_same_v<DTypeQ, DTypeKV> || kFp8KV,
                "prefill dtypes: kv is q's 16-bit type or fp8 (rules mixed-16bit-qkv, fa2-no-fp8-q)");
  static_assert(sizeof(DTypeQ) == 2 && sizeof(DTypeO) == 2, "prefill dtypes: q and o are half or bf16 (fa2-no-fp8-q)");
  static_assert(kCtaTileQ == 16 || kCtaTileQ == 64 || kCtaTileQ == 128, "prefill tile: kCtaTileQ is 16, 64 or 128");
  // Head dims are multiples of 16 (the MMAs' k step) up to 256, or 512; an fp8 cache's, of 32 (one
  // ldmatrix of K covers 32 one-byte dims). A row that does not fill whole 128-byte swizzle lines
  // (hd 80, 96, 112, 160, 224) is padded to them in shared memory; the padding is never copied,
  // read by an MMA (kMmaDQK, kMmaDVO count real 16-dim chunks) or stored.
  static constexpr bool kWide = kHeadDimQK == 512 && kHeadDimVO == 512;
  static_assert(kHeadDimQK % 16 == 0 && kHeadDimVO % 16 == 0 && ((kHeadDimQK <= 256 && kHeadDimVO <= 256) || kWide),
                "prefill head dims: multiples of 16 up to 256, or 512 (rule fa2-prefill-head-dims)");
  static_assert(!kFp8KV || (kHeadDimQK % 32 == 0 && kHeadDimVO % 32 == 0),
                "prefill fp8 KV head dims: multiples of 32 (rule fa2-fp8-kv-head-dims)");
  // rule fa2-prefill-tile (prefill_cta_tiles): 128-row tiles only up to head dim 192, where the o
  // accumulator (2 x kHeadDimVO / 2 floats per thread) beside the scores still fits the registers.
  static_assert(kCtaTileQ < 128 || kHeadDimQK <= 192, "prefill tile: kCtaTileQ 128 needs head_dim_qk <= 192");
  static constexpr int kThreads = 128;
  static constexpr int kWarps = 4;
  static constexpr int kWarpsQ = kCtaTileQ == 16 ? 1 : 4;  // warps along q rows
  // The decode-shaped tile (16 rows) takes the kv head as the fastest grid index: a request's kv heads
  // then read the same token rows at once, so a head slice that does not fill its 64-byte DRAM bursts
  // (16-bit hd 80 and 112 in NHD pages) finds its neighbours' bytes in L2 instead of fetching them again.
  static constexpr bool kKvHeadFastest = kCtaTileQ == 16;
  static constexpr int kWarpsKV = kWarps / kWarpsQ;         // warps along kv columns
  static constexpr int kMmaQ = kCtaTileQ / (16 * kWarpsQ);  // m16 row blocks per warp
  // The tile-size choice for o's columns: a warp's fp32 o accumulator holds 16 rows x kSliceVO / 32
  // floats a thread per m16 block, 128 at 256 columns, beside the scores and fragments. Head dim 512
  // (256 registers of o) therefore runs kVOSlices = 2 CTAs per work item (grid z), each over a
  // 256-column slice of V and o: both compute the same S = Q K^T over all 512 dims and the same
  // softmax (so the same m, d and lse, which slice 0 alone writes), 1.5x the MMA work of one CTA.
  // 128-column slices would keep more CTAs per SM but cost 2.5x.
  static constexpr int kSliceVO = kHeadDimVO > 256 ? 256 : kHeadDimVO;
  static constexpr int kVOSlices = kHeadDimVO / kSliceVO;
  static_assert(kSliceVO * kVOSlices == kHeadDimVO, "prefill vo slices: slices must tile head_dim_vo");
  static constexpr int kMmaDQK = kHeadDimQK / 16;
  static constexpr int kMmaDVO = kSliceVO / 16;  // o's 16-column chunks in this CTA
  // n16 kv blocks per warp (the tile-size choice, with kCtaTileQ from the planner): the score
  // fragment (kMmaQ x kMmaKV x 8 floats) stays <= 64 registers beside the o fragment, and Q + K + V
  // tiles (rows padded to whole 128-byte lines) stay <= ~110 KB so two CTAs share an SM:
  //   16-row tiles (4 warps along kv): 128 keys up to hd 128, 64 above; 256 at 16-bit hd 64, as many
  //     bytes per tile as hd 128 (the decode-shaped tile is bound by the bytes it keeps in flight);
  //   64-row tiles: 128 keys up to hd 128 (hd 128: 80 KB; hd 80-112 pad to 128), 64 above (hd 256:
  //     96 KB; hd 224 pads to 256, hd 160 to 192: 72 KB);
  //   128-row tiles (two m16 blocks per warp, hd <= 192): 64 keys (hd 192: 96 KB).
  // Past hd 128 a 128-key tile would need 2 x (Q + 2 x 128 x 192 x 2 bytes) > 227 KB.
  // An fp8 decode-shaped tile takes twice the keys: as many bytes per tile as a 16-bit one (not
  // with RoPE, whose fp16 K tile would then overflow two CTAs' shared memory).
  // Head dim 512 (V tiles of a 256-column slice): 16-row tiles keep 64 keys (Q 16 + K 64 + V 32 =
  //   112 KB), 64-row tiles take 32 (Q 64 + K 32 + V 16 = 112 KB), with the offsets 113 KB: one CTA
  //   per SM on sm80 (163 KB), two on sm90 (228 KB an SM, 1 KB of it reserved per CTA: the 16-row
  //   tile fills it to the byte). An fp8 cache's 16-row tile (128 keys, 114 KB) gets one.
  static constexpr int kMmaKV = kWarpsKV == 4 ? (kHeadDimQK <= 64 && !kFp8KV ? 4 : kHeadDimQK <= 128 ? 2 : 1) *
                                                   (kFp8KV && !kRotatedK16 ? 2 : 1)
                                : kMmaQ == 2  ? 4
                                : kWide       ? 2
                                              : (kHeadDimQK <= 128 ? 8 : 4);
  static constexpr int kTileKV = kMmaKV * kWarpsKV * 16;
  static constexpr int kCellsQK = kHeadDimQK / 8;  // 16-byte cells per row of the (16-bit) Q tile
  static constexpr int kRowCellsQ = common::swizzle_row_cells(kCellsQK);  // and in shared memory
  static constexpr int kKVPerCell = 16 / int(sizeof(DTypeKV));  // cache elements per 16-byte cell
  static constexpr int kCopyCellsQK = kHeadDimQK / kKVPerCell;   // 16-byte cells per K row of the cache
  static constexpr int kCopyCellsVO = kSliceVO / kKVPerCell;     // of the CTA's V slice
  // K/V tile rows in shared memory: whole 128-byte swizzle lines (a row of 80 16-bit or 64 fp8
  // elements is padded; its padding is never copied or read).
  static constexpr int kRowCellsQK = common::swizzle_row_cells(kCopyCellsQK);
  static constexpr int kRowCellsVO = common::swizzle_row_cells(kCopyCellsVO);
  // The tile compute_scores reads: elements per 16-byte cell and cells per row (kRowCellsQK unless
  // K is rotated into fp16).
  static constexpr int kKScoresPerCell = 16 / int(sizeof(DTypeKScores));
  static constexpr int kRowCellsKScores = common::swizzle_row_cells(kHeadDimQK / kKScoresPerCell);
  // 16-dim chunks one ldmatrix_x4 of K or V covers (16 keys of 16-byte rows): one of 16-bit
  // elements, two of fp8.
  static constexpr int kChunksPerLoadQK = kFp8KFragments ? 2 : 1;
  // compute_scores' unroll over the four 32-byte quarters of a 128-byte line (each quarter runs
  // every line of the head dim). Fully unrolled, ptxas overlaps each step's ldmatrix with the MMAs
  // before it and the first MMAs add to constant zeros: 16-bit K up to head dim 128, and up to 256
  // with one m16 block per warp, keep their loop spills (SASS per kv tile, sm90a). Otherwise rolled:
  // fp8 K (its widening needs registers; unrolled, hd 128 e4m3 took 50 LDL/STL per tile) and the
  // 128-row tile past hd 128 (hd 192: 11 LDL/STL per tile unrolled, 1 rolled).
  static constexpr int kUnrollQuartersQK = !kFp8KFragments && (kHeadDimQK <= 128 || (kMmaQ == 1 && kHeadDimQK <= 256)) ? 4 : 1;
  static constexpr int kChunksPerLoadVO = kFp8KV ? 2 : 1;
  // P's row sums by an MMA against ones (accumulate_pv) rather than fp32 adds (softmax_update): fewer
  // instructions and registers, except on the 128-row tile past 128 columns of o, where its operand
  // copies add to the accumulators' spills (hd 160: 184/256 -> 220/284 B; 192: 644/824 -> 724/992).
  // The denominator then sums the 16-bit P that multiplies V (as FlashInfer's fa2 does), so the lse
  // carries P's rounding: within P's unit roundoff of the fp32 sum (bf16: 2^-8, relative).
  static constexpr bool kRowSumMma = kMmaQ == 1 || kSliceVO <= 128;
  static constexpr int kMinCtasPerSm = kWide ? 1 : 2;
  static constexpr int kSm80SmemPerCta = 163 * 1024;  // the most an sm80 CTA may opt into
  // Without a bias or cap the scores stay raw dot products until the softmax, which folds
  // sm_scale_log2 into the FFMA ahead of each exp2 (scaling commutes with the max: the scale is > 0).
  static constexpr bool kRawScores = !kSoftCap && kPosEncoding != kPosAlibi;

  // RoPE over an fp8 cache: the rotated fp16 K tile, a base of Tiles so that it costs the other
  // variants no bytes.
  struct RotatedKTile {
    alignas(16) half k16[kTileKV * kRowCellsKScores * 8];
  };
  struct NoRotatedKTile {};
  struct Tiles : std::conditional_t<kRotatedK16, RotatedKTile, NoRotatedKTile> {
    alignas(16) DTypeMma q[kCtaTileQ * kRowCellsQ * 8];
    alignas(16) DTypeKV k[kTileKV * kRowCellsQK * kKVPerCell];
    alignas(16) DTypeKV v[kTileKV * kRowCellsVO * kKVPerCell];
    int64_t kv_offsets[2][kTileKV];  // global row offsets (bytes) of the current and the next KV tile
    // fp8 cache, bf16 q: the bits of the CTA's largest |q| (none for a 16-bit cache: its 16 bytes with
    // padding would keep two hd 512 16-row CTAs off one sm90 SM)
    unsigned q_abs_max[kFp8KV ? 1 : 0];
  };
  // Per-warp states of the column-split variant, written once the last V tile is consumed.
  struct WarpStates {
    float o[kWarpsKV][16][kSliceVO];
    float m[kWarpsKV][16];
    float d[kWarpsKV][16];
  };
  struct NoWarpStates {};
  union SharedStorage {
    Tiles tiles;
    std::conditional_t<(kWarpsKV > 1), WarpStates, NoWarpStates> states;
  };
  static_assert(sizeof(SharedStorage) * kMinCtasPerSm <= 227 * 1024, "prefill smem: kMinCtasPerSm CTAs must fit one SM");
  static_assert(!kWide || sizeof(SharedStorage) <= kSm80SmemPerCta,
                "prefill smem: a head dim 512 CTA must fit sm80 (rule fa2-head-dim-512-smem keeps sm86/sm89 out)");
};

}  // namespace attnforge::fa2
