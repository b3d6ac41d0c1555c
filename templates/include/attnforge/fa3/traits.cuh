// Role: the FA3 prefill kernel's vocabulary: PrefillTraits (every tile size, warpgroup count,
//   stage count, register split and shared-memory layout, chosen in one place from the spec's
//   dtypes and head dims), the work-tile and job types both roles share, and KernelArgs.
// Contract: the kernel is persistent: grid = min(work_capacity x num_kv_heads, SMs x CTAs per SM);
//   a job is one work item (request, q tile, kv token range [begin, end)) for one kv head. block =
//   128 threads per warpgroup: warpgroup 0 produces (TMA / cp.async loads), the next 2 or 3 consume
//   (wgmma Q K^T SS and P.V RS, online softmax in registers). A job's kBlockM = 64 x consumers rows
//   are packed (token, head-in-group) rows: row p -> token p / group, head p % group; consumer
//   warpgroup i owns rows [64 i, 64 i + 64). Plan image and params are those of host/prefill_plan.h
//   and the generated PrefillParams, shared with fa2/.
//   FP8 (e4m3 or e5m2 q, k, v; 16-bit o): the fp8 wgmma reads only K-major shared operands, so V is
//   stored transposed (kv contiguous, transpose_v.cuh). P is e4m3 whatever V's format, 2^6 times
//   the softmax weights to use its range; o / d cancels that and lse takes it back. Scales: float
//   ones are folded on the host (q_scale * k_scale into sm_scale, v_scale on o); tensor ones (per
//   head, or [1]) are read in the kernel.
// Must not: decide the work items or their order (the plan did), or be compiled for anything but
//   sm_90a (wgmma, TMA, setmaxnreg). A rule of codegen/rules.py is only static_asserted here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "../common/plan_image.cuh"
#include "../host/launch.h"
#include "../common/vec.cuh"
#include "../host/tensor_map.h"

namespace attnforge::fa3 {

template <typename T>
struct CuteElement {
  static_assert(sizeof(T) == 0, "fa3 prefill dtypes: half or __nv_bfloat16 only");
};
template <>
struct CuteElement<half> {
  using type = cutlass::half_t;
};
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__nv_fp8_e4m3> {
  using type = cutlass::float_e4m3_t;
};
template <>
struct CuteElement<__nv_fp8_e5m2> {
  using type = cutlass::float_e5m2_t;
};

// FP8 P.V: the fp8 A fragment holds, per 32 keys, lane t's keys 4t..4t+3 and 16+4t..16+4t+3 of
// rows r and r + 8, while the fp32 S accumulator holds keys 8j+2t, 8j+2t+1 (j = 0..3). Rather
// than moving values between lanes, P keeps S's keys in each lane (convert_p packs them in A's
// register order) and V's rows are put in the same order: wgmma slot k of each 16 takes the key
// p_key_of_slot(k), so the sum over keys is unchanged.
__host__ __device__ constexpr int p_key_of_slot(int slot) {
  const int lane = (slot % 16) / 4, i = slot % 4;
  return slot / 16 * 16 + 2 * lane + i % 2 + 8 * (i / 2);
}

// The swizzle line (bytes) of a tile whose rows hold `dim` elements of `element_bytes`: the widest
// of 128, 64 and 32 that divides the row (PrefillTraits::kLineBytesQK/VO).
__host__ __device__ constexpr int line_bytes(int dim, int element_bytes) {
  const int bytes = dim * element_bytes;
  return bytes % 128 == 0 ? 128 : bytes % 64 == 0 ? 64 : 32;
}

// CuTe's GMMA shared-memory atoms of one swizzle line: K-major (the line along K) and MN-major.
template <int kLineBytes, typename Element>
struct SwizzleAtoms {
  static_assert(kLineBytes == 128, "fa3 swizzle lines: 128, 64 or 32 bytes");
  using K = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using MN = cute::GMMA::Layout_MN_SW128_Atom<Element>;
};
template <typename Element>
struct SwizzleAtoms<64, Element> {
  using K = cute::GMMA::Layout_K_SW64_Atom<Element>;
  using MN = cute::GMMA::Layout_MN_SW64_Atom<Element>;
};
template <typename Element>
struct SwizzleAtoms<32, Element> {
  using K = cute::GMMA::Layout_K_SW32_Atom<Element>;
  using MN = cute::GMMA::Layout_MN_SW32_Atom<Element>;
};

struct PageRow {
  int32_t page, in_page;
};

// The CTA's share of one work item, as both roles derive it from the plan.
struct WorkTile {
  int request, qo_begin, qo_len, kv_len;
  int row_begin, rows;      // packed rows [row_begin, row_begin + rows) of the request
  int pos_shift;            // q_pos = token + pos_shift (bottom-right aligned)
  int first_token, last_token;
  int begin, end;           // kv tokens, narrowed to what some row can see
  int slot;                 // first partial slot, -1: write o directly
};

// A job as producer thread 0 hands it to its warpgroup and to the consumers: its number (>= the
// plan's jobs: none left), kv head and work item's share, read from the plan once, while the job
// before loads, because the chain of dependent loads (the item, then its request's rows and keys)
// would otherwise stall every thread at each job's start.
struct JobSlot {
  int job, kv_head;
  WorkTile work;
};

template <typename Params_, typename DTypeQ_, typename DTypeKV_, typename DTypeO_, int kHeadDimQK_, int kHeadDimVO_,
          bool kPagedKV_, bool kSoftCap_, bool kSlidingWindow_, int kDecodeRows_ = 0, bool kVtAhead_ = false>
struct PrefillTraits {
  using Params = Params_;
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimVO = kHeadDimVO_;
  static constexpr bool kPagedKV = kPagedKV_;
  static constexpr bool kSoftCap = kSoftCap_;
  static constexpr bool kSlidingWindow = kSlidingWindow_;

  static constexpr bool kFp8 = sizeof(DTypeKV) == 1;
  // The instantiations that launch_prefill picks for plans of one query token per request (the
  // tensor-core decode wrapper's), fp8 paged only; kDecodeRows: the most rows one of their items
  // holds (0: the prefill kernel). There consumer warpgroup 1, which has no rows, transposes the
  // boxed V tiles in place of the producer (consumer_transposes); items of at most 8 rows (GQA
  // groups up to 8) run with the keys along the wgmma's M (kKeysAlongM: consume_keys_along_m).
  static constexpr int kDecodeRows = kDecodeRows_;
  static constexpr bool kDecodeItems = kDecodeRows > 0;
  static constexpr bool kKeysAlongM = kDecodeItems && kDecodeRows <= 8;
  template <int kRows>
  using WithDecodeRows = PrefillTraits<Params_, DTypeQ_, DTypeKV_, DTypeO_, kHeadDimQK_, kHeadDimVO_, kPagedKV_,
                                       kSoftCap_, kSlidingWindow_, kRows>;
  // The instantiation that launch_prefill picks for fp8 prefill plans whose V the wrapper had
  // transposed ahead (p.v_transposed, by transpose_v_kernel): each tile's V^T comes by one TMA box
  // from the workspace, K-major as the PV wgmma reads it, and the producer only issues copies. Its
  // tiles start at multiples of kBlockN of the request's keys, as the transposed blocks do (tile_first).
  static constexpr bool kVtAhead = kVtAhead_;
  using WithVtAhead = PrefillTraits<Params_, DTypeQ_, DTypeKV_, DTypeO_, kHeadDimQK_, kHeadDimVO_, kPagedKV_,
                                    kSoftCap_, kSlidingWindow_, 0, true>;
  static_assert(std::is_same_v<DTypeQ, DTypeKV>, "fa3 prefill dtypes: q and kv must share one type (rule fa3-same-dtype-family)");
  static_assert(sizeof(DTypeO) == 2, "fa3 prefill dtypes: o is half or bf16 (rule o-not-fp8)");
  static constexpr int kElementBytes = int(sizeof(DTypeKV));
  // The tile-size choice for the head dims starts here (kLineBytes*, kTileDim*, then kInOrder,
  // kConsumerWarpgroups, kBlockN, kStages below). Tiles are built of column blocks of one swizzle
  // line each (a TMA box's width), the widest of 128, 64 or 32 bytes that divides the head dim's row
  // (16-bit hd 96, 160, 224: 64 bytes, 80, 112: 32; fp8 64, 192: 64, 96: 32), so every wgmma does
  // the head dim's own work. fp8 V comes apart: its rows land by 128-byte lines in staging buffers
  // (kStagingDimVO: a 96 or 192-dim row's last columns are TMA zeros, or never gathered), and the
  // transposes move the real dims into V^T, whose rows are the dims (kTileDimVO, the head dim) and
  // whose lines are 128 keys. The keys-along-M decode instance multiplies V^T P^T with the dims
  // along M, whole 64-row wgmmas: its hd 96 V^T has 128 rows, the last 32 never written, which
  // reach only O^T's unstored rows (each row of V^T P^T reads its own dim alone).
  static constexpr int kLineBytesQK = line_bytes(kHeadDimQK, kElementBytes);
  static constexpr int kLineBytesVO = kFp8 ? 128 : line_bytes(kHeadDimVO, kElementBytes);  // fp8: staged rows
  static constexpr int kLineElementsQK = kLineBytesQK / kElementBytes;
  static constexpr int kLineElementsVO = kLineBytesVO / kElementBytes;
  static constexpr int kTileDimQK = (kHeadDimQK + kLineElementsQK - 1) / kLineElementsQK * kLineElementsQK;
  static constexpr int kStagingDimVO = (kHeadDimVO + kLineElementsVO - 1) / kLineElementsVO * kLineElementsVO;
  static constexpr int kTileDimVO = !kFp8 ? kStagingDimVO : kKeysAlongM ? (kHeadDimVO + 63) / 64 * 64 : kHeadDimVO;
  static_assert(kHeadDimQK % 16 == 0 && kHeadDimVO % 16 == 0 && kHeadDimQK <= 256 && kHeadDimVO <= 256,
                "fa3 prefill head dims: multiples of 16 up to 256 (rules head-dims-multiple-of-16, prefill-head-dims-max-256)");
  static_assert(!kFp8 || kHeadDimQK == kHeadDimVO, "fa3 fp8 head dims: qk = vo (rule fa3-fp8-head-dims)");

  using Element = typename CuteElement<DTypeKV>::type;
  // P as the P.V wgmma's A operand: the 16-bit type, or e4m3 for either fp8 format (its 3 mantissa
  // bits suit weights in [0, 256]; the wgmma takes e4m3 x e5m2).
  using ElementP = std::conditional_t<kFp8, cutlass::float_e4m3_t, Element>;

  // fp8 prefill up to hd 128 and 16-bit hd 80-128 with qk = vo (no soft cap or window) run each
  // consumer warpgroup's tiles in order (run_kv_tiles_in_order): none holds S, P and o for the
  // wgmmas at once, so three warpgroups fit at 160 registers (the register file holds no second
  // overlapping one), and the others' GEMMs and softmaxes fill each one's waits (e4m3 +11% over
  // two in pingpong, docs/tried.md; 16-bit hd 80-112 +5-20% over two overlapped).
  static constexpr bool kInOrder = kFp8 ? kHeadDimVO <= 128 && !kDecodeItems
                                        : kHeadDimQK == kHeadDimVO && kHeadDimQK >= 80 && kHeadDimQK <= 128 &&
                                              !kSoftCap && !kSlidingWindow;
  // Consumer warpgroups, each owning the 64 rows of one wgmma. hd 64 takes three: its GEMMs are
  // short against the softmax, and a 192-row tile reads each K/V tile for more rows.
  static constexpr int kConsumerWarpgroups = kInOrder || (!kFp8 && kHeadDimQK == 64 && kHeadDimVO == 64) ? 3 : 2;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  // The 16-bit in-order loop issues P.V in two halves of the tile's keys and computes the second
  // half's weights while the first half's wgmmas run; fp8's P.V wgmmas are too short against its
  // exp2s for the split to pay.
  static constexpr int kPVParts = kInOrder && !kFp8 ? 2 : 1;
  // Whether the kernel has decode instantiations (WithDecodeRows) for launch_prefill to pick; the
  // keys along M up to hd 128 (at hd 256 the two P^T tiles do not fit beside two stages).
  static constexpr bool kHasDecodeItems = kFp8 && kPagedKV;
  static constexpr bool kHasKeysAlongM = kHasDecodeItems && kHeadDimQK <= 128 && kHeadDimVO <= 128;
  static_assert(!kDecodeItems || kHasDecodeItems,
                "fa3 decode items: warpgroup 1 transposes fp8 V tiles of paged items of <= 64 rows");
  static_assert(!kKeysAlongM || kHasKeysAlongM, "fa3 decode items with the keys along M: fp8 up to hd 128");
  static constexpr bool kHasVtAhead = kFp8 && !kDecodeItems;
  static_assert(!kVtAhead || kHasVtAhead, "fa3 V transposed ahead: fp8 prefill kernels only");
  // Keys per tile: Q + 2 stages of K and V must fit 227 KB: 16-bit, 128-token tiles up to tile dims
  // of 320 in all (hd 160: 200 KB, (192, 128): 208 KB), 64-token tiles for (256, 256) (192 KB). FP8
  // always takes 128 tokens: the transposed V tile's kv rows must fill a 128-byte line. Ragged
  // 16-bit hd 224 and 256 take FA3's wider 80-key tile (224 KB), and hd 192 a 112-key one (218
  // KB), whose per-tile costs cover more keys; 144 keys at hd 128 would spill at 160 registers
  // (ptxas then serializes the wgmmas, C7512). Paged kernels keep 128 or 64, which
  // every power-of-two page up to 128 divides, so their boxes are whole pages; soft cap and sliding
  // window too. kWideKvTile: the wider width, 0 where none applies.
  // A 256-wide Q tile (64 KB) leaves room for 128-token stages only beside a 64-wide V, with no
  // slack: (256, 64) and (224, 64) take the narrow tiles too.
  static constexpr int kHeadDims = kTileDimQK + kTileDimVO;
  static constexpr bool kNarrowKvTile = !kFp8 && (kHeadDims > 320 || kTileDimQK > 192);
  static constexpr int kWideKvTile =
      !kPagedKV && !kSoftCap && !kSlidingWindow && kNarrowKvTile ? (kTileDimQK <= 192 ? 112 : 80) : 0;
  static constexpr int kBlockN = kWideKvTile != 0 ? kWideKvTile : kNarrowKvTile ? 64 : 128;
  // Pingpong between the two overlapping consumer warpgroups (scheduler_wait), so one's GEMMs run
  // under the other's softmax, except for 64-key tiles, whose short GEMMs leave nothing to hide;
  // three warpgroups (hd 64, and the in-order kernels) issue when ready.
  static constexpr bool kPingpong = (kFp8 && !kInOrder) || (kConsumerWarpgroups == 2 && kBlockN > 64);
  // fp8 in-order warpgroups start each job one after another (stagger_wait): three that start
  // together queue their first wgmmas on the tensor pipe at once and their softmaxes then meet;
  // started apart, each one's GEMMs run more beside the others' softmaxes (16-bit ones do not gain).
  static constexpr bool kStaggeredStarts = kInOrder && kFp8;
  // A third K/V stage where it fits (hd <= 128 at 128 tokens, paged too: its page table is one 1 KB
  // slot); the fixed bytes are the Q tile, the page table, the slack for aligning the base and the
  // barriers.
  static constexpr int kQBytes = kBlockM * kTileDimQK * kElementBytes;
  static constexpr int kTileBytesK = kBlockN * kTileDimQK * kElementBytes;
  static constexpr int kTileBytesV = kBlockN * kTileDimVO * kElementBytes;
  static constexpr int kStageBytes = kTileBytesK + kTileBytesV;
  static constexpr int kStagingTileBytes = kBlockN * kStagingDimVO * kElementBytes;  // fp8 V rows as they lie
  // V transposed ahead comes as one box of the real dims (encode_vt_map), kTileBytesV where the
  // head dim fills the tile.
  static constexpr int kVtBoxBytes = kBlockN * kHeadDimVO * kElementBytes;
  static constexpr int kTableBytes = kPagedKV ? kBlockN * 8 : 0;
  // Whether tiles of `bytes` fit shared memory beside the page table, the barriers and the slack
  // for aligning the base.
  static constexpr bool fits_smem(int bytes) { return bytes + kTableBytes + 2048 <= 227 * 1024; }
  // FP8 V tiles come by TMA as rows into staging buffers, which the producer transposes into the
  // stage (transpose_v_tile) while the next tiles' rows land in the others: four where they fit
  // (hd 128: prefill requests rows up to three tiles ahead, and in decode items warpgroup 1's
  // transposes may trail the producer by as much), else two.
  static constexpr int kVStaging =
      !kFp8 || kVtAhead ? 0 : (fits_smem(kQBytes + 3 * kStageBytes + 4 * kStagingTileBytes) ? 4 : 2);
  static constexpr int kStagingBytes = kVStaging * kStagingTileBytes;
  // Four stages where V comes transposed ahead (hd 128: the staging buffers' room is free), else
  // three where they fit, else two.
  static constexpr int kStages =
      kVtAhead && fits_smem(kQBytes + 4 * kStageBytes) ? 4
      : fits_smem(kQBytes + 3 * kStageBytes + kStagingBytes) ? 3
                                                             : 2;
  static_assert(!kFp8 || kVtAhead || kVStaging >= 2, "fa3 fp8: the next tile's V rows need a second staging buffer");
  // A second Q buffer for 16-bit kernels where it fits beside the stages (hd 64, and hd 128 in
  // order: 48 KB each, 227 KB in all paged): jobs alternate between them, so the producer loads the
  // next job's Q as soon as it has issued this job's last tile, and a consumer warpgroup that
  // finishes a job starts the next without waiting for the others' last Q K^T and Q's load. fp8
  // keeps one: its third stage and staging buffers gain more from the room.
  static constexpr int kQBuffers =
      !kFp8 && fits_smem(2 * kQBytes + kStages * kStageBytes + kStagingBytes) ? 2 : 1;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // setmaxnreg moves registers within the launch allocation (65536 / kThreads each, rounded down to
  // 8): the producer's release must cover the consumers' growth, or their setmaxnreg.inc waits
  // forever. Two consumers: 128 x (168 - 40) >= 256 x (232 - 168), or 128 x (168 - 56) = 256 x
  // (224 - 168) where the producer does more per tile than issue two TMA boxes a row (page ids, fp8
  // V transposes, a narrow-line tile's 3-7 boxes and cell-by-cell gathers: it spills at 40). fp8 hd
  // 256's consumers hold o (128 registers), S (64) and P (16) for the wgmmas at once: below 240
  // ptxas serializes every wgmma (C7512), so the producer gets 24 (128 x (168 - 24) = 256 x (240 -
  // 168)). Three consumers: 128 x (128 - 32) = 384 x (160 - 128). With V transposed ahead, only page
  // ids are left to an fp8 producer.
  static constexpr bool kNarrowLines = kLineBytesQK < 128 || kLineBytesVO < 128;
  static constexpr bool kBusyProducer = kFp8 ? kHeadDimVO <= 128 && (kPagedKV || !kVtAhead) : kPagedKV || kNarrowLines;
  // Gathered rows copied cell by cell, this many at a time: narrow-line tiles' (more boxes per
  // tile, row cells that do not divide the warpgroup) spill the producer unrolled (ptxas, hd 80:
  // 24-56 bytes at 2, up to 208 at 4).
  static constexpr int kGatherUnroll = kNarrowLines ? 1 : 4;
  static constexpr bool kWideO = kFp8 && kHeadDimVO > 128;
  // Where producer thread 0 takes the next job and reads it from the plan (produce): once the
  // stages are full where the producer then waits for the consumers anyway (16-bit ragged), else
  // after the job's last tile: paged and fp8 producers (page ids, V transposes) are the slower role,
  // and their warpgroup would wait for thread 0 in the middle of the job.
  static constexpr bool kClaimEarly = !kFp8 && !kPagedKV;
  static constexpr int kProducerRegs = kConsumerWarpgroups == 3 ? 32 : kBusyProducer ? 56 : kWideO ? 24 : 40;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 3 ? 160 : kBusyProducer ? 224 : kWideO ? 240 : 232;
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536,
                "fa3 prefill: setmaxnreg asks for more registers than the launch holds");
  static constexpr int kCellElements = 16 / kElementBytes;  // elements per 16-byte cell
  static constexpr int kCellsQK = kHeadDimQK / kCellElements;  // cells per Q/K row of the tensors
  static constexpr int kCellsVO = kHeadDimVO / kCellElements;
  static constexpr int kTileCellsQK = kTileDimQK / kCellElements;  // and of the tiles, padding included
  static constexpr int kTileCellsVO = kTileDimVO / kCellElements;

  // K-major swizzled tiles for Q and K, one line along the head dim per atom. 16-bit V keeps its
  // natural [kv, d] rows, which the PV wgmma reads as an MN-major B operand (the descriptor may
  // transpose 16-bit types); fp8 V is stored transposed, K-major (kv contiguous, a 128-byte line of
  // 128 keys), by the producer. Tiles are laid out rows first, so each line-wide column block of a
  // stage is one contiguous TMA box.
  using AtomsQK = SwizzleAtoms<kLineBytesQK, Element>;
  using AtomsVO = SwizzleAtoms<kLineBytesVO, Element>;
  using VtAtom = std::conditional_t<kFp8, typename AtomsVO::K, typename AtomsVO::MN>;
  using VtOrder = std::conditional_t<kFp8, cute::Step<cute::_1, cute::_2, cute::_3>,
                                     cute::Step<cute::_2, cute::_1, cute::_3>>;
  static constexpr auto kMajorV = kFp8 ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using SmemLayoutQ = decltype(cute::tile_to_shape(typename AtomsQK::K{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kTileDimQK>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      typename AtomsQK::K{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kTileDimQK>, cute::Int<kStages>>{}));
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      VtAtom{}, cute::Shape<cute::Int<kTileDimVO>, cute::Int<kBlockN>, cute::Int<kStages>>{}, VtOrder{}));
  using SmemLayoutVRows = decltype(cute::tile_to_shape(
      typename AtomsVO::K{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kStagingDimVO>, cute::Int<kVStaging != 0 ? kVStaging : 1>>{}));
  // P as the PV wgmma's A operand: the 16-bit ((2, 2, 2), 1, N/16) of 16-key blocks, or the fp8
  // ((4, 2, 2), 1, N/32) of 32-key blocks; both hold S's kBlockN / 2 values per thread.
  using FragmentPShape = std::conditional_t<
      kFp8, cute::Shape<cute::Shape<cute::_4, cute::_2, cute::_2>, cute::_1, cute::Int<kBlockN / 32>>,
      cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::Int<kBlockN / 16>>>;
  // exp2 offset of P and how far (log2) a row's running max may trail its true max (move_row_max):
  // e4m3 P reaches 2^(6 + 2.8) < 448, its largest finite value, a 16-bit P 2^8. A lag lets o be
  // rescaled on fewer tiles, at the cost of a slightly coarser e4m3 P.
  static constexpr float kPExponentOffset = kFp8 ? 6.f : 0.f;
  static constexpr float kMaxLag = kFp8 ? 2.8f : 8.f;

  // One 64-row wgmma per consumer warpgroup, stacked along M.
  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kTileDimQK>>>(),
      WarpgroupsAlongM{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<ElementP, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kTileDimVO>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, kMajorV>(),
      WarpgroupsAlongM{}));

  // Keys along M: the floats of one exchange across the warps of warpgroup 0 (across_warps), one
  // per warp and row.
  static constexpr int kExchangeFloats = 4 * 8;

  struct SharedStorage {
    alignas(1024) Element q[kQBuffers * kBlockM * kTileDimQK];  // 128-byte swizzle atoms are 1024 bytes
    alignas(1024) Element k[kStages * kBlockN * kTileDimQK];
    alignas(1024) Element v[kStages * kBlockN * kTileDimVO];
    alignas(1024) Element v_rows[kVStaging * kBlockN * kStagingDimVO];  // fp8: V as it lies in memory
    // Keys along M: P^T of tiles n % 2, and the rows' maxima (by tile parity) and sums of the four
    // warps (each warp's keys are a quarter of the tile's).
    alignas(1024) ElementP p[kKeysAlongM ? 2 * 8 * kBlockN : 0];
    float row_exchange[kKeysAlongM ? 3 * kExchangeFloats : 0];
    // paged, gathered tiles: each row's page and slot in it (page -1 past end); ragged needs none.
    // One slot serves every gathered tile: it is only read while the tile's copies are issued, and
    // the producer warpgroup's barrier that ends them precedes the next fill.
    PageRow page_rows[kPagedKV ? kBlockN : 0];
    // Work items alternate between two slots: the producer's verdict on an item's page ids, and
    // the barrier that says it is written (a CTA runs its items one after another).
    int32_t item_bad_page[2];
    uint64_t item_done[2];
    // The CTA's jobs, as the producer takes them from the plan's counter: to its own warpgroup
    // (alternating: a job without kv tiles passes no other producer barrier), and to the
    // consumers through two slots, each held until the consumers have stored the job.
    JobSlot producer_jobs[2], jobs[2];
    uint64_t job_full[2], job_empty[2];
    uint64_t q_full[kQBuffers], q_empty[kQBuffers];
    uint64_t k_full[kStages], k_empty[kStages], v_full[kStages], v_empty[kStages];
    uint64_t v_rows_full[kVStaging];
    uint64_t v_rows_empty[kDecodeItems ? kVStaging : 0];  // the staging buffer's tile is transposed
  };
  // The dynamic window is only 16-byte aligned: room to round the base up to 1024.
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "fa3 prefill smem: Q + 2 stages of K and V (+ fp8 staging) exceed 227 KB");
  // The fp8 V transpose moves 4 x 4-byte blocks, and the kv reorder works on 32-key groups.
  static_assert(!kFp8 || (kBlockN % 32 == 0 && kHeadDimVO % 4 == 0), "fa3 fp8: V transposes in 4 x 4 blocks");
};

// What the kernel receives: the module's params and the TMA descriptors of K and V (encoded per
// launch, since they hold the tensors' addresses), viewed as (dim, row in page, head, page); a
// ragged tensor is one page. box_rows: rows per box (0: no tile is boxed, all are gathered);
// boxes: boxes per boxed tile.
// q_rows: Q as (dim, head, token), whose box is a tile's packed rows (q_boxed 0: Q is gathered).
template <typename T>
struct KernelArgs {
  typename T::Params p;
  CUtensorMap k_pages, v_pages, q_rows;
  CUtensorMap vt_blocks;  // V transposed ahead (kVtAhead): (key in block, dim, block, head), a block a box
  int box_rows, boxes, q_boxed;
};

// Byte offset of element `coord` in a GMMA smem layout: the linear offset, then the swizzle (which
// acts on byte addresses; the tiles sit 1024-byte aligned).
template <typename Layout, typename Element, typename... Coord>
__device__ __forceinline__ uint32_t swizzled_offset(Coord... coord) {
  const uint32_t linear = uint32_t(sizeof(Element)) * uint32_t(cute::get_nonswizzle_portion(Layout{})(coord...));
  return cute::get_swizzle_portion(Layout{})(linear);
}

// fp8 per-head scales (float32; stride 0: one value for every head); none given reads as 1.
__device__ __forceinline__ float head_scale(const void* scales, int stride, int head) {
  return scales == nullptr ? 1.f : __ldg(static_cast<const float*>(scales) + head * stride);
}

}  // namespace attnforge::fa3
