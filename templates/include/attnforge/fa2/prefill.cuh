// Role: FA2 batch prefill on tensor cores (mma.sync m16n8k16, fp32 accumulation), paged or ragged KV.
//
// Contract (/work/prefill-contract.md):
//   grid = (work_capacity, num_kv_heads); block = 128 threads (4 warps). A CTA takes one planned work
//   item (request, q tile, kv token range [begin, end)) for one kv head. Its kCtaTileQ rows are
//   packed (token, head-in-group) rows: row p -> token p / group, head p % group, so K/V are read once
//   per group. Warps split the rows (kCtaTileQ 64/128: 16/32 rows each) or, at kCtaTileQ 16, the
//   columns of every KV tile (their (m, d, o) states merge through shared memory at the end).
//   Shared memory holds the Q tile, one K tile and one V tile, each 128B-XOR-swizzled; K_{i+1} loads
//   during softmax and P.V of tile i, V_{i+1} during Q.K of tile i+1 (FlashInfer's staggered loads),
//   and two CTAs per SM hide the rest.
//   An fp8 KV cache (e4m3/e5m2, with a 16-bit q) stays fp8 in shared memory (a decode-shaped tile
//   holds twice the keys in a 16-bit tile's bytes); each warp widens the fragments it loads to fp16,
//   exactly, and runs fp16 MMAs. Its q is put in fp16 once per CTA (a bf16 one times a power
//   of two, undone in the score scale) with the dims of every 16-dim chunk in the order the fp8 K
//   fragments arrive in (prepare_q_for_fp8_kv); o's columns come out in the order V's do (o_col).
//   Its k_scale / v_scale are the caller's (folded into sm_scale_log2, applied to o after the kernel).
//   Scores live in the base-2 domain: s = q.k * sm_scale_log2 (soft cap: soft_cap_log2 * tanh(.)).
//   The kernel narrows [begin, end) to the keys its rows can see (causal, window), skips nothing
//   else, and masks only tiles that straddle a boundary.
//   Output: o (+ lse, base 2) or, when work_partial >= 0, fp32 partial rows at slot
//   work_partial + token * num_chunks[request]. A row that sees no key: o = 0, lse = -inf. Rows past
//   the request's packed length store nothing. A page id outside [0, num_pages) is never read
//   (page 0 is), the CTA's rows come out NaN and the plan's error word gets kPlanErrorBadPage.
//
// Must not: decide scheduling (the plan did) or pick the variant (the dispatcher reads cta_tile_q).
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/plan_image.cuh"
#include "../common/rope.cuh"
#include "../common/swizzle.cuh"
#include "../common/vec.cuh"

namespace attnforge::fa2 {

enum PosEncoding : int { kPosNone = 0, kPosRopeLlama = 1, kPosAlibi = 2 };

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
  static_assert(std::is_same_v<DTypeQ, DTypeKV> || kFp8KV,
                "prefill dtypes: kv is q's 16-bit type or fp8 (rules mixed-16bit-qkv, fa2-no-fp8-q)");
  static_assert(sizeof(DTypeQ) == 2 && sizeof(DTypeO) == 2, "prefill dtypes: q and o are half or bf16 (fa2-no-fp8-q)");
  static_assert(!kFp8KV || kPosEncoding != kPosRopeLlama,
                "prefill fp8 KV: no in-kernel RoPE, K stays fp8 in shared memory (rule fa2-fp8-kv-no-rope)");
  static_assert(kCtaTileQ == 16 || kCtaTileQ == 64 || kCtaTileQ == 128, "prefill tile: kCtaTileQ is 16, 64 or 128");
  static_assert(kHeadDimQK % 64 == 0 && kHeadDimVO % 64 == 0 && kHeadDimQK <= 256 && kHeadDimVO <= 256,
                "prefill head dims: 64, 128, 192 or 256 (a row must fill whole 128-byte swizzle lines)");
  // rule fa2-prefill-tile (FLASHINFER.md 4.2 step 3): 128-row tiles only below head dim 256, where
  // the o accumulator (2 x kHeadDimVO / 2 floats per thread) still fits the register file.
  static_assert(kCtaTileQ < 128 || kHeadDimVO < 256, "prefill tile: kCtaTileQ 128 needs head_dim_vo < 256");

  static constexpr int kThreads = 128;
  static constexpr int kWarps = 4;
  static constexpr int kWarpsQ = kCtaTileQ == 16 ? 1 : 4;  // warps along q rows
  static constexpr int kWarpsKV = kWarps / kWarpsQ;         // warps along kv columns
  static constexpr int kMmaQ = kCtaTileQ / (16 * kWarpsQ);  // m16 row blocks per warp
  static constexpr int kMmaDQK = kHeadDimQK / 16;
  static constexpr int kMmaDVO = kHeadDimVO / 16;
  // n16 kv blocks per warp: the score fragment (kMmaQ x kMmaKV x 8 floats) stays <= 64 registers
  // beside the o fragment, and Q + K + V tiles stay <= ~110 KB so two CTAs share an SM. An fp8
  // decode-shaped tile takes twice the keys: as many bytes per tile as a 16-bit one.
  static constexpr int kMmaKV = kWarpsKV == 4 ? (kHeadDimQK <= 128 ? 2 : 1) * (kFp8KV ? 2 : 1)
                                : kMmaQ == 2  ? 4
                                              : (kHeadDimQK <= 128 ? 8 : 4);
  static constexpr int kTileKV = kMmaKV * kWarpsKV * 16;
  static constexpr int kCellsQK = kHeadDimQK / 8;  // 16-byte cells per row of the (16-bit) Q tile
  static constexpr int kKVPerCell = 16 / int(sizeof(DTypeKV));  // cache elements per 16-byte cell
  static constexpr int kCopyCellsQK = kHeadDimQK / kKVPerCell;   // 16-byte cells per K row of the cache
  static constexpr int kCopyCellsVO = kHeadDimVO / kKVPerCell;
  // K/V tile rows in shared memory: whole 128-byte swizzle lines (an fp8 row of 64 or 192 bytes is
  // padded; its padding is never copied or read).
  static constexpr int kRowCellsQK = common::swizzle_row_cells(kCopyCellsQK);
  static constexpr int kRowCellsVO = common::swizzle_row_cells(kCopyCellsVO);
  // 16-dim chunks one ldmatrix_x4 of K or V covers (16 keys of 16-byte rows): one of 16-bit
  // elements, two of fp8.
  static constexpr int kChunksPerLoad = kFp8KV ? 2 : 1;
  static constexpr int kMinCtasPerSm = 2;
  // Without a bias or cap the scores stay raw dot products until the softmax, which folds
  // sm_scale_log2 into the FFMA ahead of each exp2 (scaling commutes with the max: the scale is > 0).
  static constexpr bool kRawScores = !kSoftCap && kPosEncoding != kPosAlibi;

  struct Tiles {
    alignas(16) DTypeMma q[kCtaTileQ * kHeadDimQK];
    alignas(16) DTypeKV k[kTileKV * kRowCellsQK * kKVPerCell];
    alignas(16) DTypeKV v[kTileKV * kRowCellsVO * kKVPerCell];
    int64_t kv_offsets[2][kTileKV];  // global row offsets of the current and the next KV tile
    unsigned q_abs_max;              // fp8 cache, bf16 q: the bits of the CTA's largest |q|
  };
  // Per-warp states of the column-split variant, written once the last V tile is consumed.
  struct WarpStates {
    float o[kWarpsKV][16][kHeadDimVO];
    float m[kWarpsKV][16];
    float d[kWarpsKV][16];
  };
  struct NoWarpStates {};
  union SharedStorage {
    Tiles tiles;
    std::conditional_t<(kWarpsKV > 1), WarpStates, NoWarpStates> states;
  };
  static_assert(sizeof(SharedStorage) * kMinCtasPerSm <= 227 * 1024, "prefill smem: kMinCtasPerSm CTAs must fit one SM");
};

// Rows of this CTA as the kernel sees them: one request, packed rows [row_begin, row_begin + rows).
struct PrefillRows {
  int request, qo_begin, qo_len, kv_len, row_begin, rows;
  int pos_shift;  // q_pos = token + pos_shift (bottom-right aligned)
};

// Online-softmax state of the rows one thread touches: fragment rows lane / 4 and lane / 4 + 8 of
// each of its kMmaQ row blocks. m, d are in the base-2 domain; d is this lane's partial sum until
// finalize() adds the other three lanes of the row.
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

// ALiBi slope of query head h (FlashInfer get_alibi_slopes): 2^(-8(h+1)/n) for the first n = 2^floor(log2 Hq)
// heads, then the odd multiples 2^(-4(2(h-n)+1)/n).
__device__ __forceinline__ float alibi_slope(int head, int num_heads) {
  const int n = 1 << (31 - __clz(num_heads));
  return head < n ? exp2f(-8.f * float(head + 1) / float(n)) : exp2f(-4.f * float(2 * (head - n) + 1) / float(n));
}

// Paged KV: each thread writes the global offsets (past the head) of tile rows threadIdx.x +
// i * kThreads into the tile's table in shared memory, 0 past `end` (the copies zero-fill those
// rows but still need an address), so each page id is read once per tile, not once per 16-byte copy
// of K and again of V. A bad page id reads page 0 and raises `bad_page`.
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
      offset = (ok ? int64_t(page) : int64_t(0)) * p.kv_stride_page + int64_t(in_page) * p.kv_stride_token;
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
// swizzled cell is the same for all of a thread's rows. Head dim 192 leaves kThreads % kCells
// threads idle.
template <typename T, int kCells>
__device__ __forceinline__ void load_kv_tile(typename T::DTypeKV* dst, const typename T::DTypeKV* head_base,
                                             int64_t token_stride, const int64_t* table, int kv_token_base,
                                             int first, int end) {
  constexpr int kRowsPerPass = T::kThreads / kCells;
  constexpr int kPasses = (T::kTileKV + kRowsPerPass - 1) / kRowsPerPass;
  const int row0 = threadIdx.x / kCells, cell = threadIdx.x % kCells;
  if (T::kThreads % kCells != 0 && row0 >= kRowsPerPass) return;
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
      row_src = src + offsets[i];
    } else {
      row_src = valid ? src : head_base;
      src += step;
    }
    common::cp_async_16(dst + common::Swizzle128<common::swizzle_row_cells(kCells)>::cell(row, cell) * T::kKVPerCell,
                        row_src, valid);
  }
}

// Rotate the K tile in shared memory (RoPE at each key's position). Callers fence around it.
template <typename T>
__device__ __forceinline__ void rope_k_tile(typename T::DTypeQ* k, int first, float rcp_scale, float rcp_theta) {
  using Vec = common::Vec16<typename T::DTypeQ>;
  constexpr int kHalf = T::kCellsQK / 2;
  for (int idx = threadIdx.x; idx < T::kTileKV * kHalf; idx += T::kThreads) {
    const int row = idx / kHalf, cell = idx % kHalf;
    auto* lo_ptr = reinterpret_cast<uint4*>(k + common::Swizzle128<T::kCellsQK>::cell(row, cell) * 8);
    auto* hi_ptr = reinterpret_cast<uint4*>(k + common::Swizzle128<T::kCellsQK>::cell(row, cell + kHalf) * 8);
    float lo[8], hi[8];
    Vec::to_float(*lo_ptr, lo);
    Vec::to_float(*hi_ptr, hi);
    common::rope_rotate<T::kHeadDimQK>(lo, hi, first + row, cell * 8, rcp_scale, rcp_theta);
    *lo_ptr = Vec::from_float(lo);
    *hi_ptr = Vec::from_float(hi);
  }
}

// Load the CTA's Q tile (packed rows) into shared memory; rows past the request are zeros. With
// RoPE the rows are rotated on the way (plain loads), otherwise copied by cp.async.
template <typename T>
__device__ __forceinline__ void load_q_tile(typename T::DTypeQ* dst, const typename T::Params& p, const PrefillRows& rows,
                                            const common::FastDivmod& group, int kv_head) {
  using DTypeQ = typename T::DTypeQ;
  constexpr int kCells = T::kCellsQK;
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
      *reinterpret_cast<uint4*>(dst + common::Swizzle128<kCells>::cell(row, cell) * 8) = Vec::from_float(lo);
      *reinterpret_cast<uint4*>(dst + common::Swizzle128<kCells>::cell(row, cell + kHalf) * 8) = Vec::from_float(hi);
    }
  } else {
    for (int idx = threadIdx.x; idx < T::kCtaTileQ * kCells; idx += T::kThreads) {
      const int row = idx / kCells, cell = idx % kCells;
      const bool valid = row < rows.rows;
      const DTypeQ* src = valid ? row_ptr(row) + cell * 8 : static_cast<const DTypeQ*>(p.q);
      common::cp_async_16(dst + common::Swizzle128<kCells>::cell(row, cell) * 8, src, valid);
    }
  }
}

// Fragment loads revisit the same lane rows (row0 + 16 i, all with row0 % 8) at even column cells
// 2 j + c0, so the swizzled cell is row * kCells + ((2 j) ^ x) with x = c0 ^ (row0 % 8) fixed per
// lane: one xor per column step and an immediate offset per row step, nothing hoisted per (i, j).
template <int kCells>
struct LaneCells {
  int row0, x;
  __device__ __forceinline__ LaneCells(int row, int c0) : row0(row), x(c0 ^ (row & 7)) {}
  __device__ __forceinline__ int at(int i, int j) const { return (row0 + 16 * i) * kCells + ((2 * j) ^ x); }
};

// An fp8 word of four one-byte elements as two registers of fp16 pairs: bytes (0, 1) and (2, 3).
template <typename T>
__device__ __forceinline__ void widen_fp8_word(uint32_t word, uint32_t& lo, uint32_t& hi) {
  lo = common::Vec16<typename T::DTypeKV>::pair_to_half2_bits(word, 0);
  hi = common::Vec16<typename T::DTypeKV>::pair_to_half2_bits(word, 1);
}

// K's B fragments for one step of 16 keys (the row addresses of LaneCells kc): b[c][0..1] for keys
// 0-7 and b[c][2..3] for keys 8-15 of the step's 16-dim chunk c. 16-bit: one ldmatrix_x4, natural
// order. fp8: matrices (keys 0-7, dims 0-15), (keys 0-7, 16-31), (keys 8-15, 0-15), (keys 8-15,
// 16-31); lane (g, t) gets dims 4t .. 4t + 3 of key g, which fill B's k slots 2t, 2t + 1 and
// 2t + 8, 2t + 9: the dim order prepare_q_for_fp8_kv gave q.
template <typename T>
__device__ __forceinline__ void load_k_fragments(const typename T::DTypeKV* row, uint32_t (&b)[T::kChunksPerLoad][4]) {
  uint32_t r[4];
  common::ldmatrix_x4(r, row);
  if constexpr (T::kFp8KV) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int keys = 0; keys < 2; ++keys) widen_fp8_word<T>(r[2 * keys + c], b[c][2 * keys], b[c][2 * keys + 1]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) b[0][i] = r[i];
  }
}

// V's B fragments (transposed) for one step of 16 keys (LaneCells vc): b[c][0..1] for the first
// n8 block of o's chunk c, b[c][2..3] for the second. 16-bit: dims 0-7 and 8-15. fp8: ldmatrix.trans
// hands lane (g, t) the byte pairs (dims 2g, 2g + 1) of keys 2t and 2t + 1; regrouped by dim, they
// are the even dims 2g (first block) and the odd dims 2g + 1 (second), which o_col follows.
template <typename T>
__device__ __forceinline__ void load_v_fragments(const typename T::DTypeKV* row, uint32_t (&b)[T::kChunksPerLoad][4]) {
  uint32_t r[4];
  common::ldmatrix_x4_trans(r, row);
  if constexpr (T::kFp8KV) {
    // matrices (keys 0-7, dims 0-15), (keys 8-15, 0-15), (keys 0-7, 16-31), (keys 8-15, 16-31)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int keys = 0; keys < 2; ++keys) {
        const uint32_t by_dim = __byte_perm(r[2 * c + keys], 0u, 0x3120u);  // (k0 d0, k1 d0, k0 d1, k1 d1)
        widen_fp8_word<T>(by_dim, b[c][keys], b[c][2 + keys]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) b[0][i] = r[i];
  }
}

// fp8 cache: rewrite the landed Q tile (16-bit, Swizzle128) for the fp16 MMAs. Each 16-dim chunk
// takes the order of load_k_fragments (stored dims 2t + j <- 4t + j, 2t + 8 + j <- 4t + 2 + j,
// t < 4, j < 2: 32-bit words 0, 2, 4, 6, 1, 3, 5, 7); a bf16 q is multiplied by the power of two
// that brings the CTA's largest |q| into [2^13, 2^14) (fp16 then keeps bf16's 8 significant bits
// down to 2^-24 of it). Returns what multiplies a score to undo it. Every Q copy must be visible
// (a barrier after the wait); the caller's next barrier publishes the result.
template <typename T>
__device__ __forceinline__ float prepare_q_for_fp8_kv(typename T::Tiles& tiles) {
  using Vec = common::Vec16<typename T::DTypeQ>;
  using Swizzle = common::Swizzle128<T::kCellsQK>;
  const uint4* cells = reinterpret_cast<const uint4*>(tiles.q);
  int shift = 0;
  if constexpr (std::is_same_v<typename T::DTypeQ, __nv_bfloat16>) {
    float abs_max = 0.f;
    for (int idx = threadIdx.x; idx < T::kCtaTileQ * T::kCellsQK; idx += T::kThreads) {
      float f[8];
      Vec::to_float(cells[Swizzle::cell(idx / T::kCellsQK, idx % T::kCellsQK)], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) abs_max = fmaxf(abs_max, fabsf(f[i]));
    }
    // Non-negative floats order as their bits.
    const unsigned warp_max = __reduce_max_sync(0xffffffffu, __float_as_uint(abs_max));
    if (threadIdx.x % 32 == 0) atomicMax(&tiles.q_abs_max, warp_max);
    __syncthreads();
    const float cta_max = __uint_as_float(tiles.q_abs_max);
    int exponent;
    frexpf(cta_max, &exponent);  // cta_max in [2^(exponent - 1), 2^exponent)
    if (cta_max > 0.f && cta_max <= FLT_MAX) shift = max(-126, min(126, 14 - exponent));
  }
  const float scale = __int_as_float((127 + shift) << 23);
  constexpr int kChunks = T::kHeadDimQK / 16;
  for (int idx = threadIdx.x; idx < T::kCtaTileQ * kChunks; idx += T::kThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    uint4* lo = reinterpret_cast<uint4*>(tiles.q) + Swizzle::cell(row, 2 * chunk);
    uint4* hi = reinterpret_cast<uint4*>(tiles.q) + Swizzle::cell(row, 2 * chunk + 1);
    float f[16];
    Vec::to_float(*lo, *reinterpret_cast<float(*)[8]>(f));
    Vec::to_float(*hi, *reinterpret_cast<float(*)[8]>(f + 8));
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = common::pack2<half>(f[2 * i] * scale, f[2 * i + 1] * scale);
    *lo = make_uint4(w[0], w[2], w[4], w[6]);
    *hi = make_uint4(w[1], w[3], w[5], w[7]);
  }
  return __int_as_float((127 - shift) << 23);
}

// s = Q . K^T for this warp's rows and kv columns (raw dot products, fp32).
template <typename T>
__device__ __forceinline__ void compute_scores(const typename T::DTypeMma* q, const typename T::DTypeKV* k, int warp_q,
                                               int warp_kv, float (&s)[T::kMmaQ][T::kMmaKV][8]) {
  constexpr int kChunks = T::kChunksPerLoad;
  const int lane = threadIdx.x % 32;
  // Q: matrices (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15).
  const LaneCells<T::kCellsQK> qc(warp_q * T::kMmaQ * 16 + lane % 16, lane / 16);
  // K: matrices (kv 0-7, cell 0), (kv 0-7, cell 1), (kv 8-15, cell 0), (kv 8-15, cell 1).
  const LaneCells<T::kRowCellsQK> kc(warp_kv * T::kMmaKV * 16 + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int mk = 0; mk < T::kMmaKV; ++mk) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s[mq][mk][e] = 0.f;
    }
  }
  // Rolled: unrolled, ptxas hoists every step's ldmatrix ahead and runs out of registers.
#pragma unroll 1
  for (int step = 0; step < T::kMmaDQK / kChunks; ++step) {
    uint32_t a[T::kMmaQ][kChunks][4];
#pragma unroll
    for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) common::ldmatrix_x4(a[mq][c], q + qc.at(mq, step * kChunks + c) * 8);
    }
#pragma unroll
    for (int mk = 0; mk < T::kMmaKV; ++mk) {
      uint32_t b[kChunks][4];
      load_k_fragments<T>(k + kc.at(mk, step) * T::kKVPerCell, b);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int mq = 0; mq < T::kMmaQ; ++mq) {
          common::mma_m16n8k16<typename T::DTypeMma>(*reinterpret_cast<float(*)[4]>(&s[mq][mk][0]), a[mq][c], b[c][0], b[c][1]);
          common::mma_m16n8k16<typename T::DTypeMma>(*reinterpret_cast<float(*)[4]>(&s[mq][mk][4]), a[mq][c], b[c][2], b[c][3]);
        }
      }
    }
  }
}

// o += P . V for this warp's rows. P arrives as base-2 probabilities in the score fragment; C
// fragment pairs (e, e + 1) are exactly the A fragment registers of the P.V mma.
template <typename T>
__device__ __forceinline__ void accumulate_pv(const typename T::DTypeKV* v, int warp_kv,
                                              const float (&s)[T::kMmaQ][T::kMmaKV][8], PrefillState<T>& st) {
  using DType = typename T::DTypeMma;
  constexpr int kChunks = T::kChunksPerLoad;
  const int lane = threadIdx.x % 32;
  // V, transposed: matrices (kv 0-7, cell 0), (kv 8-15, cell 0), (kv 0-7, cell 1), (kv 8-15, cell 1).
  const LaneCells<T::kRowCellsVO> vc(warp_kv * T::kMmaKV * 16 + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
#pragma unroll
  for (int mk = 0; mk < T::kMmaKV; ++mk) {
    uint32_t a[T::kMmaQ][4];
#pragma unroll
    for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[mq][r] = common::pack2<DType>(s[mq][mk][2 * r], s[mq][mk][2 * r + 1]);
    }
#pragma unroll
    for (int step = 0; step < T::kMmaDVO / kChunks; ++step) {
      uint32_t b[kChunks][4];
      load_v_fragments<T>(v + vc.at(mk, step) * T::kKVPerCell, b);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int mq = 0; mq < T::kMmaQ; ++mq) {
          float(&o_mq)[8] = st.o[mq][step * kChunks + c];
          common::mma_m16n8k16<DType>(*reinterpret_cast<float(*)[4]>(&o_mq[0]), a[mq], b[c][0], b[c][1]);
          common::mma_m16n8k16<DType>(*reinterpret_cast<float(*)[4]>(&o_mq[4]), a[mq], b[c][2], b[c][3]);
        }
      }
    }
  }
}

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

// Online-softmax step: fold the tile's scores into (m, d), rescale o, and turn the scores into
// probabilities 2^(s * scale - m) in place. `scale` turns the scores into base-2 units:
// sm_scale_log2 for raw scores, 1 once transform_scores has applied it.
template <typename T>
__device__ __forceinline__ void softmax_update(float (&s)[T::kMmaQ][T::kMmaKV][8], float scale, PrefillState<T>& st) {
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
      const float alpha = common::fast_exp2(st.m[mq][rr] - m_safe);
      st.m[mq][rr] = m_new;
      st.d[mq][rr] *= alpha;
#pragma unroll
      for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (frag_row_half(e) == rr) st.o[mq][dv][e] *= alpha;
        }
      }
#pragma unroll
      for (int mk = 0; mk < T::kMmaKV; ++mk) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (frag_row_half(e) == rr) {
            s[mq][mk][e] = common::fast_exp2(fmaf(s[mq][mk][e], scale, -m_safe));
            st.d[mq][rr] += s[mq][mk][e];
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

// Normalize and store this warp's rows: o/lse directly, or the fp32 partial slot of the chunk.
template <typename T>
__device__ __forceinline__ void store_rows(const typename T::Params& p, const PrefillRows& rows, const RowCoords<T>& rc,
                                           int kv_head, int warp_q, int slot,
                                           bool bad_page, PrefillState<T>& st) {
  using DTypeO = typename T::DTypeO;
  const int lane = threadIdx.x % 32;
  const int32_t* plan = static_cast<const int32_t*>(p.plan);
  const int num_chunks = slot >= 0 ? plan[p.off_num_chunks + rows.request] : 0;
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = (warp_q * T::kMmaQ + mq) * 16 + rr * 8 + lane / 4;
      if (row >= rows.rows) continue;
      const int token = rc.token[mq][rr];
      const int qo_head = kv_head * p.group_size + (rows.row_begin + row - token * p.group_size);
      const float d = st.d[mq][rr];
      const float inv_d = bad_page ? NAN : (d > 0.f ? 1.f / d : 0.f);
      const float lse = bad_page ? NAN : (d > 0.f ? st.m[mq][rr] + log2f(d) : common::kNegInf);
      if (slot < 0) {
        DTypeO* o_row = static_cast<DTypeO*>(p.o) + int64_t(rows.qo_begin + token) * p.o_stride_n + int64_t(qo_head) * p.o_stride_h;
#pragma unroll
        for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
          for (int pair = 0; pair < 2; ++pair) {
            const int e = o_pair_first<T>(rr, pair);
            *reinterpret_cast<uint32_t*>(o_row + o_col<T>(dv, e, lane)) =
                common::pack2<DTypeO>(st.o[mq][dv][e] * inv_d, st.o[mq][dv][e + kOPairStep<T>] * inv_d);
          }
        }
        if (p.lse != nullptr && lane % 4 == 0) {
          static_cast<float*>(p.lse)[int64_t(rows.qo_begin + token) * p.num_qo_heads + qo_head] = lse;
        }
      } else {
        const int64_t prow = int64_t(slot + token * num_chunks) * p.num_qo_heads + qo_head;
        float* partial = static_cast<float*>(p.tmp_v) + prow * T::kHeadDimVO;
#pragma unroll
        for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
          for (int pair = 0; pair < 2; ++pair) {
            const int e = o_pair_first<T>(rr, pair);
            *reinterpret_cast<float2*>(partial + o_col<T>(dv, e, lane)) =
                make_float2(st.o[mq][dv][e] * inv_d, st.o[mq][dv][e + kOPairStep<T>] * inv_d);
          }
        }
        if (lane % 4 == 0) static_cast<float*>(p.tmp_s)[prow] = lse;
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(T::kThreads, T::kMinCtasPerSm) prefill_kernel(const __grid_constant__ typename T::Params p) {
  using DTypeQ = typename T::DTypeQ;
  using DTypeKV = typename T::DTypeKV;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  int32_t* plan = static_cast<int32_t*>(p.plan);

  const int work = blockIdx.x;
  if (work >= plan[common::kPlanNumWork]) return;  // padding of a static (CUDA-graph) grid
  const int kv_head = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_q = warp % T::kWarpsQ, warp_kv = warp / T::kWarpsQ;

  PrefillRows rows;
  rows.request = plan[p.off_work_request + work];
  rows.qo_begin = plan[p.off_qo_indptr + rows.request];
  rows.qo_len = plan[p.off_qo_indptr + rows.request + 1] - rows.qo_begin;
  rows.kv_len = plan[p.off_kv_len + rows.request];
  rows.row_begin = plan[p.off_work_qo_tile + work] * T::kCtaTileQ;
  rows.rows = min(T::kCtaTileQ, rows.qo_len * p.group_size - rows.row_begin);
  rows.pos_shift = rows.kv_len - rows.qo_len;
  const int slot = plan[p.off_work_partial + work];
  const common::FastDivmod group(p.group_size);

  // Narrow the planned range to the keys some row of this tile can see.
  const int first_token = group.div(rows.row_begin);
  const int last_token = group.div(rows.row_begin + max(rows.rows, 1) - 1);
  int begin = plan[p.off_work_kv_begin + work];
  int end = plan[p.off_work_kv_end + work];
  const bool causal = !T::kCustomMask && p.causal;
  if (causal) end = min(end, last_token + rows.pos_shift + 1);
  if constexpr (T::kSlidingWindow) begin = max(begin, first_token + rows.pos_shift - p.window_left);

  RowCoords<T> rc;
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = (warp_q * T::kMmaQ + mq) * 16 + rr * 8 + lane / 4;
      rc.token[mq][rr] = group.div(rows.row_begin + row);
      if constexpr (T::kPosEncoding == kPosAlibi) {
        const int qo_head = kv_head * p.group_size + (rows.row_begin + row - rc.token[mq][rr] * p.group_size);
        constexpr float kLog2e = 1.4426950408889634f;
        // Bias in score units: base 2, and divided by the cap when a soft cap follows.
        const float unit = T::kSoftCap ? kLog2e / p.soft_cap_log2 : kLog2e;
        rc.alibi[mq][rr] = alibi_slope(qo_head, p.num_qo_heads) * unit;
      }
    }
  }

  load_q_tile<T>(reinterpret_cast<DTypeQ*>(smem.tiles.q), p, rows, group, kv_head);
  common::cp_async_commit();
  if (T::kFp8KV && threadIdx.x == 0) smem.tiles.q_abs_max = 0u;

  const auto* k_head = static_cast<const DTypeKV*>(p.k) + kv_head * p.kv_stride_head;
  const auto* v_head = static_cast<const DTypeKV*>(p.v) + kv_head * p.v_stride_head;
  const int32_t* page_ids = static_cast<const int32_t*>(p.indices) + (T::kPagedKV ? plan[p.off_kv_indptr + rows.request] : 0);
  const int kv_token_base = T::kPagedKV ? 0 : plan[p.off_kv_indptr + rows.request];
  const common::FastDivmod page_size(T::kPagedKV ? p.page_size : 1);
  bool bad_page = false;
  auto fill_offsets = [&](int tile) {
    if constexpr (T::kPagedKV) {
      fill_kv_offsets<T>(smem.tiles.kv_offsets[tile % 2], p, page_ids, page_size, begin + tile * T::kTileKV, end, bad_page);
    }
  };
  auto load_k = [&](int tile) {
    load_kv_tile<T, T::kCopyCellsQK>(smem.tiles.k, k_head, p.kv_stride_token, smem.tiles.kv_offsets[tile % 2],
                                     kv_token_base, begin + tile * T::kTileKV, end);
  };
  auto load_v = [&](int tile) {
    load_kv_tile<T, T::kCopyCellsVO>(smem.tiles.v, v_head, p.v_stride_token, smem.tiles.kv_offsets[tile % 2],
                                     kv_token_base, begin + tile * T::kTileKV, end);
  };

  const int num_tiles = end > begin ? (end - begin + T::kTileKV - 1) / T::kTileKV : 0;
  fill_offsets(0);
  if constexpr (T::kPagedKV) __syncthreads();
  if (num_tiles > 0) load_k(0);
  common::cp_async_commit();
  float score_scale = p.sm_scale_log2;
  if constexpr (T::kFp8KV) {
    common::cp_async_wait<1>();  // Q has landed; K_0 stays in flight
    __syncthreads();
    score_scale *= prepare_q_for_fp8_kv<T>(smem.tiles);
  }

  // Tiles from here on need no causal / window mask: every row sees every column.
  const int q_pos_first = first_token + rows.pos_shift, q_pos_last = last_token + rows.pos_shift;

  // Two barriers per tile (FlashAttention-2's order): V_tile loads during Q.K of the tile, K_{tile+1}
  // during its softmax and P.V.
  PrefillState<T> st;
  st.init();
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int first = begin + tile * T::kTileKV;
    common::cp_async_wait<0>();  // Q and K_tile have landed
    __syncthreads();  // every warp is done with V_{tile-1}, and with table (tile + 1) % 2
    load_v(tile);
    common::cp_async_commit();
    if constexpr (T::kPosEncoding == kPosRopeLlama) {
      rope_k_tile<T>(smem.tiles.k, first, p.rope_rcp_scale, p.rope_rcp_theta);
      __syncthreads();
    }
    float s[T::kMmaQ][T::kMmaKV][8];
    compute_scores<T>(smem.tiles.q, smem.tiles.k, warp_q, warp_kv, s);
    if (tile + 1 < num_tiles) fill_offsets(tile + 1);
    common::cp_async_wait<0>();  // V_tile has landed
    __syncthreads();  // K is consumed (refill it while softmax and P.V run); the next table is written
    if (tile + 1 < num_tiles) load_k(tile + 1);
    common::cp_async_commit();

    const int last_col = first + T::kTileKV - 1;
    bool boundary = T::kCustomMask || last_col >= end || (causal && last_col > q_pos_first);
    if constexpr (T::kSlidingWindow) boundary = boundary || first < q_pos_last - p.window_left;
    if constexpr (!T::kRawScores) transform_scores<T>(p, score_scale, rows, rc, first, warp_kv, s);
    if (boundary) mask_scores<T>(p, rows, rc, first, end, warp_kv, s);
    softmax_update<T>(s, T::kRawScores ? score_scale : 1.f, st);
    accumulate_pv<T>(smem.tiles.v, warp_kv, s, st);
  }
  common::cp_async_wait<0>();

  // Complete each row's denominator over the quad that shares it.
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      st.d[mq][rr] += __shfl_xor_sync(0xffffffffu, st.d[mq][rr], 1);
      st.d[mq][rr] += __shfl_xor_sync(0xffffffffu, st.d[mq][rr], 2);
    }
  }
  bad_page = __syncthreads_or(bad_page);  // also: every warp is done with the tiles
  if (bad_page && threadIdx.x == 0) atomicOr(&plan[common::kPlanError], common::kPlanErrorBadPage);
  if constexpr (T::kWarpsKV > 1) {
    merge_warp_states<T>(smem, warp_kv, st);
    if (warp_kv != 0) return;
  }
  store_rows<T>(p, rows, rc, kv_head, warp_q, slot, bad_page, st);
}

template <typename T>
cudaError_t prefill_set_smem() {
  constexpr int kSmem = sizeof(typename T::SharedStorage);
  // Above 48 KB the opt-in must be set per device; setting it every launch is cheap and correct for
  // processes that drive several GPUs.
  if constexpr (kSmem > 48 * 1024) {
    return cudaFuncSetAttribute(prefill_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_prefill(const typename T::Params& p, cudaStream_t stream) {
  const cudaError_t err = prefill_set_smem<T>();
  if (err != cudaSuccess) return err;
  const dim3 grid(p.work_capacity, p.num_kv_heads);
  prefill_kernel<T><<<grid, T::kThreads, sizeof(typename T::SharedStorage), stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t prefill_occupancy(int* ctas_per_sm) {
  const cudaError_t err = prefill_set_smem<T>();
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, prefill_kernel<T>, T::kThreads,
                                                       sizeof(typename T::SharedStorage));
}

}  // namespace attnforge::fa2
