// Role: FA3 batch prefill for Hopper (sm_90a), persistent: a producer warpgroup fills a 2-3 stage
//   shared-memory ring with K/V tiles (TMA where a tile lies inside the request and its pages allow,
//   else a cp.async gather), two or three consumer warpgroups run wgmma (QK^T SS, PV RS) and the
//   online softmax in registers.
//   FP8 (e4m3 or e5m2 q, k, v; 16-bit o): the fp8 wgmma reads only K-major shared operands, so V
//   is stored transposed (kv contiguous): boxed V tiles land by TMA as rows in staging buffers
//   (several, so later tiles' rows land during this tile's transpose) and the producer transposes
//   them into the stage with ldmatrix and byte permutes (in the decode instantiation, one query
//   token per request, consumer warpgroup 1 has no rows and does it instead: consumer_transposes,
//   and items of at most 8 rows put the keys along the wgmma's M: consume_keys_along_m);
//   gathered V tiles are transposed on their way from global memory. The kv order within each 32
//   keys is the one P's registers come in (p_key_of_slot). P is e4m3 whatever V's format, 2^6
//   times the softmax weights to use its range; o / d cancels that and lse takes it back.
//   Scales: float ones as everywhere (q_scale * k_scale folded into sm_scale, o times v_scale on
//   the host); tensor ones (per head, or [1]) are read here: q and k scales into each row's score
//   factor, the kv head's v scale into the output's normalization.
//
// Contract (/work/prefill-contract.md), the same plan image and params as fa2/prefill.cuh:
//   Persistent: grid = min(work_capacity x num_kv_heads, SMs x CTAs per SM). A job is one work
//   item (request, q tile, kv token range [begin, end)) for one kv head, numbered kv-head-major
//   in the plan's order (longest items first); a CTA runs job blockIdx.x, then takes the next
//   untaken one from the plan's job counter until none is left (the counter is 0 again after each
//   launch), 16-bit ragged kernels one job ahead (kClaimEarly). block = 128 threads per
//   warpgroup: warpgroup 0 produces, the next 2 (16-bit hd 64 and 128, fp8 hd 128: 3) consume.
//   A job's kBlockM = 64 x consumers rows are packed (token, head-in-group) rows: row p -> token
//   p / group, head p % group; consumer warpgroup i owns rows [64 i, 64 i + 64).
//   Q: the producer loads the tile into the job's Q buffer (16-bit kernels: two where they fit,
//   alternating) once the last Q K^T of the job that held it before is done (q_empty): by TMA, a
//   box of whole tokens' group heads per 128-byte column block, when the group divides the tile
//   and q's strides allow, else by cp.async; then q_full. The producer thus runs into the next job
//   while the consumers finish this one; each job's page-id verdict reaches the consumers through
//   one of two item slots (item_done). K/V: for each kBlockN-token tile the producer waits for the
//   stage's `empty` mbarrier, then fills the stage and the `full` mbarrier counts the bytes, so
//   consumers wait for the data itself, not for the producer; stages and phases run on across a
//   CTA's jobs (PipelineCount). Tiles that lie inside [begin, end) come by TMA, one
//   box per 128-byte column block, the boxes spread over the lanes of the four producer warps:
//   ragged tiles whole (a request's partial last tile ends at the request's end: tile_first),
//   paged ones a page per box when the page size is a multiple of 8 rows and the tile is whole
//   pages (or lies in one page). The rest (a paged item's tile holding `end`, a ragged request
//   shorter than a tile) are gathered with 16-byte cp.async by the whole warpgroup (zero-filled
//   past `end`, so P.V never meets rows past the request, which may hold anything; paged rows
//   through the stage-independent table of (page, row in page)).
//   Scores live in the base-2 domain: max and sum use s * sm_scale_log2, folded into the exp2
//   FFMA (soft cap: s = soft_cap_log2 * tanh(s * sm_scale_log2), then a unit scale).
//   Causal / window: [begin, end) is narrowed to the keys some row sees, so tiles past the
//   diagonal are never loaded; only tiles that straddle a boundary are masked per element.
//   Output: o (+ lse, base 2) or, when work_partial >= 0, fp32 partial rows at slot
//   work_partial + token * num_chunks[request]. A row that sees no key: o = 0, lse = -inf. A page
//   id outside [0, num_pages) is never read (page 0 is), the job's rows come out NaN and the plan's
//   error word gets kPlanErrorBadPage.
//
// Must not: decide the work items or their order (the plan did) or run on anything but sm_90a
//   (wgmma, setmaxnreg).
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
#include "../common/plan_image.cuh"
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
// plan's jobs: none left), kv head and work item's share, read from the plan once (a chain of
// dependent loads: the job's item, then its request's rows and keys). Same-run A/B, bf16 hd 128,
// of thread 0 reading it while the job before loads against every thread reading it from the
// plan at the job's start (and the consumers again at its store): causal +2..+5% at 4 x 4096
// and 16 x 1024 tokens, non-causal 1 x 16384 +1.5%.
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
  // Rows must fill whole 128-byte swizzle lines (a TMA box's width): 64 16-bit or 128 fp8 elements.
  static constexpr int kLineElements = host::kTmaBoxBytes / kElementBytes;
  static_assert(kHeadDimQK % kLineElements == 0 && kHeadDimVO % kLineElements == 0 && kHeadDimQK <= 256 &&
                    kHeadDimVO <= 256,
                "fa3 prefill head dims: multiples of 64 (16-bit) or 128 (fp8) up to 256 (rule fa3-head-dims)");

  using Element = typename CuteElement<DTypeKV>::type;
  // P as the P.V wgmma's A operand: the 16-bit type, or e4m3 for either fp8 format (its 3 mantissa
  // bits suit weights in [0, 256]; the wgmma takes e4m3 x e5m2).
  using ElementP = std::conditional_t<kFp8, cutlass::float_e4m3_t, Element>;

  // fp8 prefill up to hd 128 and 16-bit hd 128 (no soft cap or window) run each consumer
  // warpgroup's tiles in order (run_kv_tiles_in_order): none holds S, P and o for the wgmmas at
  // once, so three warpgroups fit at 160 registers, and the others' GEMMs and softmaxes fill each
  // one's waits. Same-run A/B against two overlapping warpgroups in pingpong (4 x 4096, 32 / 8
  // heads): e4m3 +11% non-causal, +5% causal (1 x 16384 +10..+12%, paged +8..+10%); bf16, in two
  // runs, +2..+2.5% / +0.5..+1%, paged +3% / +0.5..+3%, 16 x 1024 +4..+6% (its 176-key tiles
  // become 128 keys in two stages). P through shared memory (stmatrix, an SS P.V wgmma) so that
  // three fp8 warpgroups could overlap S and P.V like two lost 10% to this.
  static constexpr bool kInOrder = kFp8 ? kHeadDimVO <= 128 && !kDecodeItems
                                        : kHeadDimQK == 128 && kHeadDimVO == 128 && !kSoftCap && !kSlidingWindow;
  // Consumer warpgroups, each owning the 64 rows of one wgmma. hd 64 takes three: its GEMMs are
  // short against the softmax, and a 192-row tile reads each K/V tile for more rows.
  static constexpr int kConsumerWarpgroups = kInOrder || (!kFp8 && kHeadDimQK == 64 && kHeadDimVO == 64) ? 3 : 2;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  // The 16-bit in-order loop issues P.V in two halves of the tile's keys and computes the second
  // half's weights while the first half's wgmmas run. Same-run A/B, bf16 hd 128, 4 x 4096:
  // +4.5% non-causal, +2.5% causal, paged +3.6% / +2.9%, 1 x 16384 +4.4% / +2.7%, 16 x 1024
  // +2.8% / +0.7%; four quarters +1.5..+3.5%. e4m3 within noise either way (-1.3..+3.4%): its
  // four P.V wgmmas are short against the weights' exp2s.
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
  // Q + 2 stages of K and V must fit 227 KB: 16-bit, 128-token tiles up to (192, 128) head dims
  // (208 KB), 64-token tiles for (256, 256) (192 KB). FP8 always takes 128 tokens: the transposed V
  // tile's kv rows must fill a 128-byte line, and (256, 256) then fits two stages and the staging.
  // Ragged 16-bit hd 256 takes FA3's wider tile, whose per-tile costs cover more keys: 80 in two
  // stages (224 KB; against 64: +3..+6%). hd 128 took 176 in two stages until it ran in order; in
  // order 112 keys in three stages lost 1-8% to 128 in two, and 144 keys spill at 160 registers
  // (ptxas then serializes the wgmmas: C7512). Paged kernels keep 128 or 64, which every
  // power-of-two page up to 128 divides (their boxes are whole pages; paged hd 256 in 80-key tiles
  // measured no faster); soft cap and sliding window too. kWideKvTile: the wider width, 0 where
  // none applies.
  static constexpr int kHeadDims = kHeadDimQK + kHeadDimVO;
  static constexpr int kWideKvTile = !kFp8 && !kPagedKV && !kSoftCap && !kSlidingWindow && kHeadDims > 320 ? 80 : 0;
  static constexpr int kBlockN = kWideKvTile != 0 ? kWideKvTile : kFp8 || kHeadDims <= 320 ? 128 : 64;
  // Pingpong between the consumer warpgroups (scheduler_wait) except where a same-run A/B found the
  // warpgroups faster issuing when ready: 16-bit hd 256 in 64-key tiles (bf16 ragged +2..+5%
  // without it; its 80-key ragged tiles are 1% faster with it) and hd 64 (a ring of three,
  // +2..+4%). hd 128 loses 4-6% without it; fp8 and (192, 128) are within noise either way.
  // In-order kernels issue when ready: a ring of three (turns at Q K^T) lost 5-9% at e4m3 hd 128.
  static constexpr bool kPingpong = (kFp8 && !kInOrder) || (kConsumerWarpgroups == 2 && kBlockN > 64);
  // fp8 in-order warpgroups start each job one after another (stagger_wait): three that start
  // together queue their first wgmmas on the tensor pipe at once and their softmaxes then meet;
  // started apart, each one's GEMMs run more beside the others' softmaxes. Same-run A/Bs in the
  // design notes (twenty-fifth session): e4m3 hd 128 faster, more so without the per-tile fence
  // (GatheredOperands); later starting points (after the first tile's weighing, its P, its P.V)
  // slower; bf16 slower.
  static constexpr bool kStaggeredStarts = kInOrder && kFp8;
  // A third K/V stage where it fits (hd <= 128 at 128 tokens, paged too: its page table is one 1 KB
  // slot); the fixed bytes are the Q tile, the page table, the slack for aligning the base and the
  // barriers.
  static constexpr int kQBytes = kBlockM * kHeadDimQK * kElementBytes;
  static constexpr int kTileBytesK = kBlockN * kHeadDimQK * kElementBytes;
  static constexpr int kTileBytesV = kBlockN * kHeadDimVO * kElementBytes;
  static constexpr int kStageBytes = kTileBytesK + kTileBytesV;
  static constexpr int kTableBytes = kPagedKV ? kBlockN * 8 : 0;
  // Whether tiles of `bytes` fit shared memory beside the page table, the barriers and the slack
  // for aligning the base.
  static constexpr bool fits_smem(int bytes) { return bytes + kTableBytes + 2048 <= 227 * 1024; }
  // FP8 V tiles come by TMA as rows into staging buffers, which the producer transposes into the
  // stage (transpose_v_tile) while the next tiles' rows land in the others: four where they fit
  // (hd 128: prefill requests rows up to three tiles ahead, and in decode items warpgroup 1's
  // transposes may trail the producer by as much), else two.
  static constexpr int kVStaging =
      !kFp8 || kVtAhead ? 0 : (fits_smem(kQBytes + 3 * kStageBytes + 4 * kTileBytesV) ? 4 : 2);
  static constexpr int kStagingBytes = kVStaging * kTileBytesV;
  // Four where V comes transposed (hd 128: no staging buffers; same-run A/B against three, e4m3
  // 4 x 4096 non-causal +1..+2%, ragged and paged, 16 x 1024 +1.5%, causal within noise).
  static constexpr int kStages =
      kVtAhead && fits_smem(kQBytes + 4 * kStageBytes) ? 4
      : fits_smem(kQBytes + 3 * kStageBytes + kStagingBytes) ? 3
                                                             : 2;
  static_assert(!kFp8 || kVtAhead || kVStaging >= 2, "fa3 fp8: the next tile's V rows need a second staging buffer");
  // A second Q buffer for 16-bit kernels where it fits beside the stages (hd 64, and hd 128 in
  // order: 48 KB each, 227 KB in all paged): jobs alternate between them, so the producer loads the
  // next job's Q as soon as it has issued this job's last tile, and a consumer warpgroup that
  // finishes a job starts the next without waiting for the others' last Q K^T and Q's load.
  // Same-run A/B, bf16 hd 128: 4 x 4096 +2% non-causal, +0.7% causal, paged +3.6% / +2.7%,
  // 1 x 16384 +4% / +1%; hd 64 within noise; e4m3 hd 128 within noise or below (-1.5% at
  // 16 x 1024), so fp8 keeps one.
  static constexpr int kQBuffers =
      !kFp8 && fits_smem(2 * kQBytes + kStages * kStageBytes + kStagingBytes) ? 2 : 1;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // setmaxnreg moves registers within the launch allocation (65536 / kThreads each, rounded down to
  // 8): the producer's release must cover the consumers' growth, or their setmaxnreg.inc waits
  // forever. Two consumers: 128 x (168 - 40) >= 256 x (232 - 168) (48 for the producer hangs), or
  // 128 x (168 - 56) = 256 x (224 - 168) where the producer does more per tile than issue TMA
  // boxes and the consumers fit 224: 16-bit paged (page ids; paged hd 256 +10% at 1 x 16384,
  // same-run A/B) and fp8 up to hd 128 (V transposes: it spilled 92 bytes at 40). fp8 hd 256's
  // consumers hold o (128 registers), S (64) and P (16) for the wgmmas at once: at 232 ptxas
  // serialized every wgmma of the kernel (C7512), so they take 240 and the producer 24
  // (128 x (168 - 24) = 256 x (240 - 168)), which it spills to. Three consumers:
  // 128 x (128 - 32) = 384 x (160 - 128).
  // With V transposed ahead, only page ids are left to an fp8 producer.
  static constexpr bool kBusyProducer = kFp8 ? kHeadDimVO <= 128 && (kPagedKV || !kVtAhead) : kPagedKV;
  static constexpr bool kWideO = kFp8 && kHeadDimVO > 128;
  // Where producer thread 0 takes the next job and reads it from the plan (produce): once the
  // stages are full where the producer then waits for the consumers (16-bit ragged), else after
  // the job's last tile. Paged and fp8 producers (page ids, V transposes) are the slower role, and
  // their warpgroup would wait for thread 0 in the middle of the job: fp8 tensor-core decode with
  // the early claim (and the next Q's L2 prefetch, neutral alone), same-run A/B, 155 -> 158 us
  // (group 1), 156 -> 161 us (group 8); paged prefill read 1-3% lower with it (two runs compared,
  // not a same-run A/B).
  static constexpr bool kClaimEarly = !kFp8 && !kPagedKV;
  static constexpr int kProducerRegs = kConsumerWarpgroups == 3 ? 32 : kBusyProducer ? 56 : kWideO ? 24 : 40;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 3 ? 160 : kBusyProducer ? 224 : kWideO ? 240 : 232;
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536,
                "fa3 prefill: setmaxnreg asks for more registers than the launch holds");
  static constexpr int kCellElements = 16 / kElementBytes;  // elements per 16-byte cell
  static constexpr int kCellsQK = kHeadDimQK / kCellElements;  // cells per Q/K row
  static constexpr int kCellsVO = kHeadDimVO / kCellElements;

  // K-major 128B-swizzled tiles for Q and K. 16-bit V keeps its natural [kv, d] rows, which the PV
  // wgmma reads as an MN-major B operand (the descriptor may transpose 16-bit types); fp8 V is
  // stored transposed, K-major (kv contiguous), by the producer. 16-bit tiles are laid out rows
  // first, so each 64-dim column block of a stage is one contiguous TMA box.
  using VtAtom = std::conditional_t<kFp8, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                    cute::GMMA::Layout_MN_SW128_Atom<Element>>;
  using VtOrder = std::conditional_t<kFp8, cute::Step<cute::_1, cute::_2, cute::_3>,
                                     cute::Step<cute::_2, cute::_1, cute::_3>>;
  static constexpr auto kMajorV = kFp8 ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using SmemLayoutQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimQK>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimQK>, cute::Int<kStages>>{}));
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      VtAtom{}, cute::Shape<cute::Int<kHeadDimVO>, cute::Int<kBlockN>, cute::Int<kStages>>{}, VtOrder{}));
  using SmemLayoutVRows = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimVO>, cute::Int<kVStaging != 0 ? kVStaging : 1>>{}));
  // P as the PV wgmma's A operand: the 16-bit ((2, 2, 2), 1, N/16) of 16-key blocks, or the fp8
  // ((4, 2, 2), 1, N/32) of 32-key blocks; both hold S's kBlockN / 2 values per thread.
  using FragmentPShape = std::conditional_t<
      kFp8, cute::Shape<cute::Shape<cute::_4, cute::_2, cute::_2>, cute::_1, cute::Int<kBlockN / 32>>,
      cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::Int<kBlockN / 16>>>;
  // exp2 offset of P and how far (log2) a row's running max may trail its true max (move_row_max):
  // e4m3 P reaches 2^(6 + 2.8) < 448, its largest finite value, a 16-bit P 2^8. Against offset 8 and
  // lag 0.8 (same-run A/B, e4m3 hd 128): o is rescaled on fewer tiles, 4 x 4096 causal +3.5%, 16 x 1024
  // +1.5..+3%, non-causal 4 x 4096 and 1 x 16384 +0..+1%; o's relative L2 error 2.54e-2 -> 2.62e-2.
  static constexpr float kPExponentOffset = kFp8 ? 6.f : 0.f;
  static constexpr float kMaxLag = kFp8 ? 2.8f : 8.f;

  // One 64-row wgmma per consumer warpgroup, stacked along M.
  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDimQK>>>(),
      WarpgroupsAlongM{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<ElementP, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kHeadDimVO>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, kMajorV>(),
      WarpgroupsAlongM{}));

  // Keys along M: the floats of one exchange across the warps of warpgroup 0 (across_warps), one
  // per warp and row.
  static constexpr int kExchangeFloats = 4 * 8;

  struct SharedStorage {
    alignas(1024) Element q[kQBuffers * kBlockM * kHeadDimQK];  // swizzle atoms are 1024 bytes
    alignas(1024) Element k[kStages * kBlockN * kHeadDimQK];
    alignas(1024) Element v[kStages * kBlockN * kHeadDimVO];
    alignas(1024) Element v_rows[kVStaging * kBlockN * kHeadDimVO];  // fp8: V as it lies in memory
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

// Named barrier ids (0 is __syncthreads).
constexpr int kBarrierProducer = 1;  // the producer warpgroup among itself (page table written, gathered copies issued)
constexpr int kBarrierTransposer = 5;  // consumer warpgroup 1 transposing fp8 V tiles, among itself

template <typename T>
__device__ __forceinline__ WorkTile load_work_tile(const typename T::Params& p, const int32_t* plan, int work,
                                                   const common::FastDivmod& group) {
  WorkTile w;
  w.request = plan[p.off_work_request + work];
  w.qo_begin = plan[p.off_qo_indptr + w.request];
  w.qo_len = plan[p.off_qo_indptr + w.request + 1] - w.qo_begin;
  w.kv_len = plan[p.off_kv_len + w.request];
  w.row_begin = plan[p.off_work_qo_tile + work] * T::kBlockM;
  w.rows = min(T::kBlockM, w.qo_len * p.group_size - w.row_begin);
  w.pos_shift = w.kv_len - w.qo_len;
  w.first_token = group.div(w.row_begin);
  w.last_token = group.div(w.row_begin + max(w.rows, 1) - 1);
  w.begin = plan[p.off_work_kv_begin + work];
  w.end = plan[p.off_work_kv_end + work];
  if (p.causal) w.end = min(w.end, w.last_token + w.pos_shift + 1);
  if constexpr (T::kSlidingWindow) {
    if (p.window_left >= 0) w.begin = max(w.begin, w.first_token + w.pos_shift - p.window_left);
  }
  w.slot = plan[p.off_work_partial + work];
  return w;
}

// Tile 0's first key: w.begin, or with V transposed ahead the kBlockN multiple at or before it,
// where the request's transposed block starts.
template <typename T>
__device__ __forceinline__ int tile_origin(const WorkTile& w) {
  return T::kVtAhead ? w.begin / T::kBlockN * T::kBlockN : w.begin;
}

template <typename T>
__device__ __forceinline__ int num_kv_tiles(const WorkTile& w) {
  return w.end > w.begin ? (w.end - tile_origin<T>(w) + T::kBlockN - 1) / T::kBlockN : 0;
}

// Tile n's first key. Tiles cover the item's keys from w.begin on, kBlockN apart (tile n "from"
// w.begin + n kBlockN); a ragged item's partial last tile, where the request holds kBlockN keys
// up to w.end, starts at w.end - kBlockN instead, reaching back over keys the tile before it took
// (KeyMask hides those): it stays inside the request and is one TMA box, where the partial tile was
// a gathered copy (cp.async, zero-filled past w.end): same-run A/B, bf16 hd 128, +1.5..+3% at
// 4 x 4096 tokens, +5% at 16 x 1024.
// With V transposed ahead the tiles are the transposed blocks (tile_origin on, kBlockN apart): the
// first may reach back before w.begin, the last past w.end (its V^T is zeros there, and the mask
// hides the keys whatever K holds).
template <typename T>
__device__ __forceinline__ int tile_from(const WorkTile& w, int n) {
  if constexpr (T::kVtAhead) return max(w.begin, tile_origin<T>(w) + n * T::kBlockN);
  return w.begin + n * T::kBlockN;
}
template <typename T>
__device__ __forceinline__ int tile_first(const WorkTile& w, int n) {
  if constexpr (T::kVtAhead) return tile_origin<T>(w) + n * T::kBlockN;
  const int from = tile_from<T>(w, n);
  if constexpr (T::kPagedKV) return from;
  return from + T::kBlockN > w.end && w.end >= T::kBlockN ? w.end - T::kBlockN : from;
}

// A job: one work item for one kv head. Kv-head-major, so the CTAs running at once mostly share one
// kv head's K/V in L2; within a head the plan's order, longest items first.
struct Job {
  int work, kv_head;
};
__device__ __forceinline__ Job job_of(int job, int num_work) { return {job % num_work, job / num_work}; }

// The plan's jobs: its work items x kv heads. Read from the plan where needed rather than kept:
// a register held across the kv loop is one the softmax lacks.
template <typename Params>
__device__ __forceinline__ int num_jobs_of(const Params& p) {
  return static_cast<const int32_t*>(p.plan)[common::kPlanNumWork] * p.num_kv_heads;
}
template <typename Params>
__device__ __forceinline__ Job job_of(const Params& p, int job) {
  return job_of(job, static_cast<const int32_t*>(p.plan)[common::kPlanNumWork]);
}

// Where a CTA's pipelines stand, counted over its work items so far, alike in both roles: kv
// tiles (tile n of the current item has stage (tiles + n) % kStages), fp8 V tiles transposed
// (the producer's staging buffers), and items with kv tiles (Q's barrier phase, the item slot).
template <int kStages>
struct PipelineCount {
  int tiles = 0, staged = 0, items = 0;

  __device__ __forceinline__ int stage(int n) const { return (tiles + n) % kStages; }
  __device__ __forceinline__ uint32_t phase(int n) const { return uint32_t((tiles + n) / kStages) & 1; }
  __device__ __forceinline__ void advance(int num_tiles) { tiles += num_tiles; }
};

// Item `item`'s Q buffer (items with kv tiles alternate between T::kQBuffers): its tile, its
// barriers and their phase for the item.
template <typename T>
struct QBuffer {
  typename T::Element* tile;
  uint64_t* full;
  uint64_t* empty;
  uint32_t phase;
};
template <typename T>
__device__ __forceinline__ QBuffer<T> q_buffer(typename T::SharedStorage& smem, int item) {
  const int b = item % T::kQBuffers;
  return {smem.q + b * T::kBlockM * T::kHeadDimQK, &smem.q_full[b], &smem.q_empty[b],
          uint32_t(item / T::kQBuffers) & 1};
}

// Byte offset of element `coord` in a GMMA smem layout: the linear offset, then the 128B swizzle
// (which acts on byte addresses; the tiles sit 1024-byte aligned).
template <typename Layout, typename Element, typename... Coord>
__device__ __forceinline__ uint32_t swizzled_offset(Coord... coord) {
  const uint32_t linear = uint32_t(sizeof(Element)) * uint32_t(cute::get_nonswizzle_portion(Layout{})(coord...));
  return cute::get_swizzle_portion(Layout{})(linear);
}

__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(common::smem_addr(bar)));
}

// ---------------------------------------------------------------------------------------------
// Producer warpgroup

// Q tile: kBlockM packed rows, then q_full. Boxed: thread 0 loads one box per 128-byte column
// block (rows past the request hold the next request's queries, or zeros past q: no stored row
// reads them). Gathered (a group that does not divide the tile, or strides TMA cannot take): every
// producer thread's cp.async, zeros past the request.
template <typename T>
__device__ __forceinline__ void load_q_tile(typename T::SharedStorage& smem, const KernelArgs<T>& args,
                                            const WorkTile& w, const common::FastDivmod& group, int kv_head,
                                            const QBuffer<T>& q, int tid) {
  using DTypeQ = typename T::DTypeQ;
  const auto& p = args.p;
  auto* base = reinterpret_cast<uint8_t*>(q.tile);
  if (args.q_boxed) {
    if (tid != 0) return;
    const auto evict_first = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);  // read once
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(q.full, T::kQBytes);
#pragma unroll
    for (int col = 0; col < T::kHeadDimQK; col += T::kLineElements) {
      cute::SM90_TMA_LOAD_3D::copy(&args.q_rows, q.full, evict_first,
                                   base + swizzled_offset<typename T::SmemLayoutQ, typename T::Element>(0, col), col,
                                   kv_head * p.group_size, w.qo_begin + w.first_token);
    }
    return;
  }
  for (int idx = tid; idx < T::kBlockM * T::kCellsQK; idx += T::kProducerThreads) {
    const int row = idx / T::kCellsQK, cell = idx % T::kCellsQK;
    const bool valid = row < w.rows;
    const DTypeQ* src = static_cast<const DTypeQ*>(p.q);
    if (valid) {
      int token, head_in_group;
      group.divmod(w.row_begin + row, token, head_in_group);
      src += int64_t(w.qo_begin + token) * p.q_stride_n + int64_t(kv_head * p.group_size + head_in_group) * p.q_stride_h +
             cell * T::kCellElements;
    }
    common::cp_async_16(base + swizzled_offset<typename T::SmemLayoutQ, typename T::Element>(row, cell * T::kCellElements),
                        src, valid);
  }
  cp_async_arrive_noinc(q.full);
}

// A paged token's (page, row in page). A page id outside [0, num_pages) reads page 0 instead and
// raises `bad_page`: the job's rows then come out NaN (see store_rows).
__device__ __forceinline__ PageRow resolve_page(const int32_t* page_ids, const common::FastDivmod& page_size,
                                                int num_pages, int token, bool& bad_page) {
  PageRow row;
  int page_index;
  page_size.divmod(token, page_index, row.in_page);
  const int id = __ldg(page_ids + page_index);
  const bool ok = static_cast<unsigned>(id) < static_cast<unsigned>(num_pages);
  bad_page |= !ok;
  row.page = ok ? id : 0;
  return row;
}

// Paged KV, gathered tile: thread `row` looks its token's page up once for both K and V; rows
// past `end` get page -1 (zero-filled).
template <typename T>
__device__ __forceinline__ void fill_page_table(PageRow* table, const typename T::Params& p, const int32_t* page_ids,
                                                const common::FastDivmod& page_size, int first, int end, int tid,
                                                bool& bad_page) {
  if (tid >= T::kBlockN) return;
  const int token = first + tid;
  table[tid] = token < end ? resolve_page(page_ids, page_size, p.num_pages, token, bad_page) : PageRow{-1, 0};
}

// A gathered tile's row offsets (elements): through the page table (paged), or from the request's
// first token (ragged); -1 past `end`, which the copies zero-fill.
template <typename T>
__device__ __forceinline__ auto gathered_rows(const PageRow* table, int first, int end, int kv_token_base,
                                              int64_t page_stride, int64_t token_stride) {
  return [=](int row) -> int64_t {
    if constexpr (T::kPagedKV) {
      const PageRow r = table[row];
      return r.page < 0 ? int64_t(-1) : int64_t(r.page) * page_stride + int64_t(r.in_page) * token_stride;
    } else {
      return first + row < end ? int64_t(kv_token_base + first + row) * token_stride : int64_t(-1);
    }
  };
}

// One K or V tile: kBlockN rows of kCells 16-byte cells, row offsets from `row_offset(row)` (-1:
// past the range, zero-filled so P.V never meets garbage), smem position from `smem_offset`.
// A thread keeps one cell and walks rows kRowsPerPass apart; when that is a whole number of
// 8-row swizzle atoms its smem position only moves by a constant, so it is computed once. A row
// of cells that does not divide the warpgroup (24 for 192 16-bit dims) is copied cell by cell,
// each thread finding its cell's row.
template <typename T, int kCells, typename RowOffset, typename SmemOffset>
__device__ __forceinline__ void load_kv_tile(uint8_t* smem_base, const typename T::DTypeKV* head_base, int tid,
                                             RowOffset row_offset, SmemOffset smem_offset) {
  if constexpr (T::kProducerThreads % kCells != 0) {
    static_assert(T::kBlockN * kCells % T::kProducerThreads == 0, "fa3 kv tile: every producer thread copies alike");
#pragma unroll 4
    for (int idx = tid; idx < T::kBlockN * kCells; idx += T::kProducerThreads) {
      const int row = idx / kCells, cell = idx % kCells;
      const int64_t off = row_offset(row);
      common::cp_async_16(smem_base + smem_offset(row, cell), head_base + max(off, int64_t(0)) + cell * T::kCellElements,
                          off >= 0);
    }
  } else {
    constexpr int kRowsPerPass = T::kProducerThreads / kCells;
    constexpr int kCopies = T::kBlockN / kRowsPerPass;
    static_assert(T::kProducerThreads % kCells == 0 && T::kBlockN % kRowsPerPass == 0,
                  "fa3 kv tile: every producer thread copies alike");
    const int cell = tid % kCells, row0 = tid / kCells;
    const uint32_t base = smem_offset(row0, cell);
    const uint32_t step = smem_offset(kRowsPerPass, 0) - smem_offset(0, 0);
    // Partly unrolled: fully, the hoisted 64-bit source addresses overflow the producer's 40 registers.
#pragma unroll 4
    for (int i = 0; i < kCopies; ++i) {
      const int row = row0 + i * kRowsPerPass;
      const int64_t off = row_offset(row);
      const uint32_t dst = kRowsPerPass % 8 == 0 ? base + i * step : smem_offset(row, cell);
      common::cp_async_16(smem_base + dst, head_base + max(off, int64_t(0)) + cell * T::kCellElements, off >= 0);
    }
  }
}

// Whether the tile at `first` comes by TMA (the same answer in every producer thread): it starts a
// page, or lies in one. The producer is bound by its instructions' latency (fp8 paged), so the
// page size divides by multiplication.
template <typename T>
__device__ __forceinline__ bool tile_is_boxed(const KernelArgs<T>& args, const WorkTile& w,
                                              const common::FastDivmod& page_size, int first) {
  if (args.box_rows == 0) return false;
  // Ragged K past w.end (V transposed ahead): the next request's keys or the map's zeros, masked;
  // unless the whole tensor is shorter than a tile (the map's box then is too).
  if (T::kVtAhead && !T::kPagedKV) return args.box_rows == T::kBlockN;
  if (first + T::kBlockN > w.end) return false;
  if constexpr (!T::kPagedKV) return true;
  int page_index, in_page;
  page_size.divmod(first, page_index, in_page);
  return in_page == 0 || in_page + T::kBlockN <= int(page_size.divisor);
}

// Decode items (kDecodeItems): an item of at most 64 rows leaves consumer warpgroup 1 without
// rows, so it transposes the item's boxed V tiles in place of the producer, whose chain of
// instructions per tile limits decode (design notes). Both roles decide alike, per item; a staging
// buffer is then free once its tile's transposer arrives on v_rows_empty.
template <typename T>
__device__ __forceinline__ bool consumer_transposes(const WorkTile& w) {
  return T::kDecodeItems && w.rows <= 64;
}

// The item's boxed tiles, each of which takes the next fp8 staging buffer, as both roles count them.
template <typename T>
__device__ __forceinline__ int num_boxed_tiles(const KernelArgs<T>& args, const WorkTile& w,
                                               const common::FastDivmod& page_size, int num_tiles) {
  int boxed = 0;
  for (int n = 0; n < num_tiles; ++n) boxed += tile_is_boxed<T>(args, w, page_size, tile_first<T>(w, n));
  return boxed;
}

// A boxed tile as the producer warps load it: lane l of warp w takes the rows of box 4 l + w (a
// page, or the whole ragged tile). A TMA copy's coordinates live in uniform registers, so a warp
// issues its lanes' boxes one after another; spread over the four warps, a tile of 16-row pages
// (8 pages, 32 boxes for hd 128) issues in a quarter of the time, and the page ids are read in
// parallel.
struct TileBoxes {
  PageRow origin;    // this lane's box: (page, first row in it)
  int row;           // the box's first row in the tile
  bool boxing;       // whether this lane has a box
  bool warp_boxing;  // whether this warp has any (lane 0 has box w), so waits for the stage
  bool kv_read_once;  // whether no other q tile reads the tile
};

template <typename T>
__device__ __forceinline__ TileBoxes tile_boxes(const KernelArgs<T>& args, const int32_t* page_ids,
                                                const common::FastDivmod& page_size, int kv_token_base, int first,
                                                bool kv_read_once, bool& bad_page) {
  constexpr int kWarps = T::kProducerThreads / 32;
  const int box = threadIdx.x % 32 * kWarps + threadIdx.x / 32;
  // ragged: one page of every row
  TileBoxes t{PageRow{0, kv_token_base + first}, box * args.box_rows, box < args.boxes,
              int(threadIdx.x / 32) < args.boxes, kv_read_once};
  if (T::kPagedKV && t.boxing) t.origin = resolve_page(page_ids, page_size, args.p.num_pages, first + t.row, bad_page);
  return t;
}

// Each producer lane with a box copies its every 128-byte column block of one tile of `map` into
// `tile`, element (row, col) at smem_offset(row, col). Thread 0 arms `full` with the whole tile's
// bytes; other warps' copies may land first (the barrier's transaction count may run negative until
// then, and its phase cannot complete before thread 0's arrival).
template <typename T, int kDims, typename SmemOffset>
__device__ __forceinline__ void box_tile(const CUtensorMap& map, const TileBoxes& boxes, int kv_head,
                                         uint8_t* tile, uint64_t* full, uint32_t bytes, SmemOffset smem_offset) {
  // K/V that the request's other q tiles reread stay in L2; a request of one q tile (decode) reads
  // them once, and they leave room for what is reread, the page ids among it.
  const auto hint = static_cast<uint64_t>(boxes.kv_read_once ? cute::TMA::CacheHintSm90::EVICT_FIRST
                                                             : cute::TMA::CacheHintSm90::EVICT_LAST);
  if (threadIdx.x == 0) cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, bytes);
  if (!boxes.boxing) return;
#pragma unroll
  for (int col = 0; col < kDims; col += T::kLineElements) {
    cute::SM90_TMA_LOAD_4D::copy(&map, full, hint, tile + smem_offset(boxes.row, col), col, boxes.origin.in_page,
                                 kv_head, boxes.origin.page);
  }
}

// Every producer warp with boxes: its boxes of the K tile into the stage, and of the 16-bit V tile
// (fp8 V goes through box_v_rows), each once the stage is free.
template <typename T>
__device__ __forceinline__ void load_kv_tile_tma(typename T::SharedStorage& smem, const KernelArgs<T>& args,
                                                 const TileBoxes& boxes, int stage, uint32_t free_phase, int kv_head) {
  using Barrier = cutlass::arch::ClusterBarrier;
  using Element = typename T::Element;
  if (!boxes.warp_boxing) return;  // spinning on the stage's barriers would take issue slots from the consumers
  Barrier::wait(&smem.k_empty[stage], free_phase);
  box_tile<T, T::kHeadDimQK>(args.k_pages, boxes, kv_head, reinterpret_cast<uint8_t*>(smem.k),
                             &smem.k_full[stage], T::kTileBytesK, [&](int row, int col) {
                               return swizzled_offset<typename T::SmemLayoutK, Element>(row, col, stage);
                             });
  if constexpr (!T::kFp8) {
    Barrier::wait(&smem.v_empty[stage], free_phase);
    box_tile<T, T::kHeadDimVO>(args.v_pages, boxes, kv_head, reinterpret_cast<uint8_t*>(smem.v),
                               &smem.v_full[stage], T::kTileBytesV, [&](int row, int col) {
                                 return swizzled_offset<typename T::SmemLayoutVt, Element>(col, row, stage);
                               });
  }
}

// V transposed ahead: transposed block `block` of the kv head, K-major as the PV wgmma reads it, into
// the stage once it is free; one box, producer thread 0's.
template <typename T>
__device__ __forceinline__ void box_vt_tile(typename T::SharedStorage& smem, const KernelArgs<T>& args, int block,
                                            int stage, uint32_t free_phase, int kv_head) {
  if (threadIdx.x != 0) return;
  const auto evict_last = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_LAST);  // every q tile rereads it
  cutlass::arch::ClusterBarrier::wait(&smem.v_empty[stage], free_phase);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.v_full[stage], T::kTileBytesV);
  cute::SM90_TMA_LOAD_4D::copy(&args.vt_blocks, &smem.v_full[stage], evict_last,
                               reinterpret_cast<uint8_t*>(smem.v) + stage * T::kTileBytesV, 0, 0, block, kv_head);
}

// Every producer warp, fp8: its boxes of a V tile's rows, as they lie in memory, into staging
// buffer `buffer`.
template <typename T>
__device__ __forceinline__ void box_v_rows(typename T::SharedStorage& smem, const KernelArgs<T>& args,
                                           const TileBoxes& boxes, int buffer, int kv_head) {
  box_tile<T, T::kHeadDimVO>(args.v_pages, boxes, kv_head, reinterpret_cast<uint8_t*>(smem.v_rows),
                             &smem.v_rows_full[buffer], T::kTileBytesV, [&](int row, int col) {
                               return swizzled_offset<typename T::SmemLayoutVRows, typename T::Element>(row, col, buffer);
                             });
}

// Byte selectors of the first transpose step: interleave two keys' dims 0-1 (or 2-3), each also
// with the two keys swapped.
constexpr uint32_t kPairsLow = 0x5140, kPairsHigh = 0x7362;                // k0d0 k1d0 k0d1 k1d1 | d2 d3
constexpr uint32_t kPairsLowSwapped = 0x1504, kPairsHighSwapped = 0x3726;  // k1d0 k0d0 k1d1 k0d1 | d2 d3

// Bytes (key i, dim c) of four keys' words -> word c holds dim c of keys 0..3, in key order. The
// selectors may swap keys 0 <-> 1 and 2 <-> 3 (the swapped pairs) and dims 0-1 <-> 2-3 (the pairs'
// roles exchanged: words 0, 1 then hold dims 2, 3).
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&key_words)[4], uint32_t (&dim_words)[4],
                                                    uint32_t first_pairs = kPairsLow,
                                                    uint32_t second_pairs = kPairsHigh) {
  const uint32_t first01 = __byte_perm(key_words[0], key_words[1], first_pairs);
  const uint32_t first23 = __byte_perm(key_words[2], key_words[3], first_pairs);
  const uint32_t second01 = __byte_perm(key_words[0], key_words[1], second_pairs);
  const uint32_t second23 = __byte_perm(key_words[2], key_words[3], second_pairs);
  dim_words[0] = __byte_perm(first01, first23, 0x5410);
  dim_words[1] = __byte_perm(first01, first23, 0x7632);
  dim_words[2] = __byte_perm(second01, second23, 0x5410);
  dim_words[3] = __byte_perm(second01, second23, 0x7632);
}

// FP8 V tile from its staged rows: Vt(d, slot) = V(p_key_of_slot(slot), d). A slot word (4 slots)
// holds keys x, x + 1, x + 8, x + 9 (x = 16 (w / 4) + 2 (w % 4) for word w of a 32-key group).
// Warp g moves key group g, one ldmatrix.x4 per 16-byte dim chunk: matrix m's row j is key
// x_j + {0, 1, 8, 9}[m], except that rows 4-7 take m's partner (m ^ 1), so each matrix's 8 rows sit
// in distinct swizzle chunks. Lane t then holds dims 4 (t % 4) .. + 3 of the 4 keys of word t / 4,
// transposes them with byte permutes (whose selectors also undo the partner swap) and stores one
// word per dim; lanes with t % 4 >= 2 store their dims in an order shifted by 2, which puts each
// store's 32 words in distinct banks. Addresses: moving a chunk moves the source's swizzled
// 16-byte column (an XOR within the 128-byte row, then a 128-dim block) and the destination by 16
// rows (whose swizzle is the same: it depends on the row mod 8).
template <typename T>
__device__ __forceinline__ void transpose_v_tile(typename T::SharedStorage& smem, int buffer, int stage, int tid) {
  using Element = typename T::Element;
  constexpr int kChunks = T::kHeadDimVO / 16, kLineChunks = 8, kBlockBytes = T::kBlockN * 128;
  static_assert(T::kBlockN == 32 * (T::kProducerThreads / 32), "fa3 fp8 V transpose: warp g moves key group g");
  const int lane = tid % 32, group = tid / 32;
  const int row = lane % 8, partner = (lane / 8) ^ (row / 4);
  const int row_key = 32 * group + 16 * (row / 4) + 2 * (row % 4) + (partner & 1) + 8 * (partner >> 1);
  const int word = lane / 4, dim0 = 4 * (lane % 4);
  const bool partnered = word >= 4, shifted = lane % 4 >= 2;
  const uint32_t pair_lo = partnered ? kPairsLowSwapped : kPairsLow;
  const uint32_t pair_hi = partnered ? kPairsHighSwapped : kPairsHigh;
  const uint32_t first_pairs = shifted ? pair_hi : pair_lo, second_pairs = shifted ? pair_lo : pair_hi;
  const uint32_t src = common::smem_addr(smem.v_rows) +
                       swizzled_offset<typename T::SmemLayoutVRows, Element>(row_key, 0, buffer);
  uint32_t dst[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[i] = common::smem_addr(smem.v) + swizzled_offset<typename T::SmemLayoutVt, Element>(
                                             dim0 + (shifted ? (i + 2) % 4 : i), 32 * group + 4 * word, stage);
  }
  // ldmatrix and the stores are volatile asm, kept in source order: chunk c + 1's ldmatrix goes
  // out before chunk c's stores (ptxas puts it after the chunk's permutes), so its latency
  // overlaps them.
  auto load_chunk = [&](uint32_t (&keys)[4], int chunk) {
    common::ldmatrix_x4(keys, (src ^ (chunk % kLineChunks * 16)) + chunk / kLineChunks * kBlockBytes);
  };
  uint32_t keys[2][4];
  load_chunk(keys[0], 0);
#pragma unroll
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    if (chunk + 1 < kChunks) load_chunk(keys[(chunk + 1) % 2], chunk + 1);
    uint32_t words[4];
    transpose_4x4_bytes(keys[chunk % 2], words, first_pairs, second_pairs);
#pragma unroll
    for (int i = 0; i < 4; ++i) common::store_shared_u32(dst[i] + chunk * 16 * T::kBlockN, words[i]);
  }
}

// FP8 V tile gathered and transposed: Vt(d, slot) = V(p_key_of_slot(slot), d), K-major for the PV wgmma.
// A thread reads 4 bytes (4 dims) of each of the 4 keys of 4 consecutive slots and writes them
// as 4 words of 4 slots, one per dim (a 4 x 4 byte transpose in registers). Consecutive threads
// take consecutive dims, so a warp reads 128 contiguous bytes of each key. Keys past the range
// read as zeros (row offset -1), as in the gather.
template <typename T, typename RowOffset>
__device__ __forceinline__ void load_v_tile_transposed(uint8_t* smem_base, const typename T::DTypeKV* head_base, int tid,
                                                       RowOffset row_offset, int stage) {
  constexpr int kDimGroups = T::kHeadDimVO / 4, kBlocks = kDimGroups * T::kBlockN / 4;
  static_assert(kBlocks % T::kProducerThreads == 0, "fa3 fp8 V transpose: every producer thread moves alike");
  const uint32_t vt = common::smem_addr(smem_base);
  // Not unrolled: the producer has 40 registers.
#pragma unroll 1
  for (int b = tid; b < kBlocks; b += T::kProducerThreads) {
    const int dim = b % kDimGroups * 4, slot = b / kDimGroups * 4;
    uint32_t key_words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t off = row_offset(p_key_of_slot(slot + i));
      key_words[i] = off >= 0 ? __ldg(reinterpret_cast<const uint32_t*>(head_base + off + dim)) : 0u;
    }
    uint32_t dim_words[4];
    transpose_4x4_bytes(key_words, dim_words);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      common::store_shared_u32(
          vt + swizzled_offset<typename T::SmemLayoutVt, typename T::Element>(dim + c, slot, stage), dim_words[c]);
    }
  }
}

// The whole warpgroup's plain stores into a stage are done: made visible to the wgmma (async
// proxy), the warpgroup met on its named barrier, then its thread 0 arrives on `full` for all.
__device__ __forceinline__ void arrive_stored(uint64_t* full, int barrier, int tid) {
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
  if (tid == 0) cutlass::arch::ClusterBarrier::arrive(full);
}

// A boxed fp8 tile's V rows, once they and the stage are ready, transposed from their staging
// buffer (number `staged` of the CTA) into the stage; then v_full and, in decode items, the
// buffer's release. By the producer warpgroup, or in decode items by consumer warpgroup 1
// (`barrier`: the transposing warpgroup's own named barrier; `tid` its thread).
template <typename T>
__device__ __forceinline__ void transpose_staged_v(typename T::SharedStorage& smem, int staged, int stage,
                                                   uint32_t free_phase, int tid, int barrier) {
  const int buffer = staged % T::kVStaging;
  cutlass::arch::ClusterTransactionBarrier::wait(&smem.v_rows_full[buffer], (staged / T::kVStaging) & 1);
  cutlass::arch::ClusterBarrier::wait(&smem.v_empty[stage], free_phase);
  transpose_v_tile<T>(smem, buffer, stage, tid);
  arrive_stored(&smem.v_full[stage], barrier, tid);
  if (T::kDecodeItems && tid == 0) cutlass::arch::ClusterBarrier::arrive(&smem.v_rows_empty[buffer]);
}

// The whole warpgroup's cp.async copies into a stage are done: count them on `full`, which
// expects one arrival (a TMA tile's is its thread's): each thread's copies are added to the
// pending count, and thread 0 arrives once all have been.
__device__ __forceinline__ void arrive_gathered(uint64_t* full, int tid) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(common::smem_addr(full)));
  cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrierProducer);
  if (tid == 0) cutlass::arch::ClusterBarrier::arrive(full);
}

// Whether any producer thread's `pred` holds (a barrier of the producer warpgroup).
__device__ __forceinline__ bool producer_any(bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "n"(kBarrierProducer), "n"(cutlass::NumThreadsPerWarpGroup));
  return any != 0;
}

// The producer's last word on an item (after all its tiles): whether some page id was bad, into
// the item's slot, and the slot's barrier; the plan's error word too.
template <typename T>
__device__ __forceinline__ void report_item(typename T::SharedStorage& smem, int32_t* plan, int item, bool bad_page,
                                            int tid) {
  bad_page = producer_any(bad_page);
  if (tid != 0) return;
  smem.item_bad_page[item % 2] = bad_page;
  cutlass::arch::ClusterBarrier::arrive(&smem.item_done[item % 2]);
  if (bad_page) atomicOr(&plan[common::kPlanError], common::kPlanErrorBadPage);
}

template <typename T, typename ClaimNext>
__device__ __forceinline__ void produce(typename T::SharedStorage& smem, const KernelArgs<T>& args, const JobSlot& job,
                                        const common::FastDivmod& group, PipelineCount<T::kStages>& count,
                                        ClaimNext claim_next) {
  using DTypeKV = typename T::DTypeKV;
  using Barrier = cutlass::arch::ClusterBarrier;
  const auto& p = args.p;
  auto* plan = static_cast<int32_t*>(p.plan);
  const int tid = threadIdx.x;
  const int kv_head = job.kv_head;
  const WorkTile w = job.work;
  const int num_tiles = num_kv_tiles<T>(w);
  if (num_tiles == 0) {  // consumers store zeros without waiting for anything
    claim_next();
    return;
  }

  const QBuffer<T> q = q_buffer<T>(smem, count.items);
  Barrier::wait(q.empty, q.phase ^ 1);  // the last Q K^T of the item that had the buffer before is done
  load_q_tile<T>(smem, args, w, group, kv_head, q, tid);
  bool bad_page = false;

  const auto* k_head = static_cast<const DTypeKV*>(p.k) + kv_head * p.kv_stride_head;
  const auto* v_head = static_cast<const DTypeKV*>(p.v) + kv_head * p.v_stride_head;
  const int32_t* page_ids = static_cast<const int32_t*>(p.indices) + (T::kPagedKV ? plan[p.off_kv_indptr + w.request] : 0);
  const int kv_token_base = T::kPagedKV ? 0 : plan[p.off_kv_indptr + w.request];
  const common::FastDivmod page_size(T::kPagedKV ? p.page_size : 1);
  auto* k_smem = reinterpret_cast<uint8_t*>(smem.k);
  auto* v_smem = reinterpret_cast<uint8_t*>(smem.v);
  // Paged only: decode's requests have one q tile; a ragged producer's 40 registers have no room.
  const bool kv_read_once = T::kPagedKV && w.qo_len * p.group_size <= T::kBlockM;
  const bool by_consumer = consumer_transposes<T>(w);
  // V transposed ahead: the request's first transposed block (of kBlockN keys).
  const int vt_block = T::kVtAhead ? plan[p.off_vt_block + w.request] : 0;
  auto box_vt = [&](int first, int stage, uint32_t free_phase) {
    box_vt_tile<T>(smem, args, vt_block + first / T::kBlockN, stage, free_phase, kv_head);
  };

  // fp8: the first tile whose V rows are not yet requested.
  int unrequested = 0;
  for (int n = 0; n < num_tiles; ++n) {
    if (T::kClaimEarly && n == T::kStages) claim_next();
    const int stage = count.stage(n);
    const uint32_t free_phase = count.phase(n) ^ 1;  // a fresh barrier counts as released
    const int first = tile_first<T>(w, n);
    if (tile_is_boxed<T>(args, w, page_size, first)) {
      if constexpr (T::kFp8 && !T::kVtAhead) {
        // Prefill: V rows for this tile and the boxed tiles right after it, as far as the staging
        // buffers reach (tile n + i takes buffer (staged + i) % kVStaging, whose last tile was
        // transposed before an earlier barrier), so their latency hides behind the transposes;
        // then K. K's page ids are read first, so their latency overlaps the later V rows'; tile
        // n's own V rows reuse them.
        // Decode items: K first, then this tile's V rows alone. Rows requested ahead wait for
        // their buffers' transposes by warpgroup 1, which trail warpgroup 0's tiles, and K issued
        // behind them came late (ncu: warpgroup 0 waited on k_full a third of its time); same-run
        // A/B 170 -> 159 us with K first, 155 without looking ahead. In prefill, K first cost the
        // paged tiles 2%.
        const TileBoxes k_boxes = tile_boxes<T>(args, page_ids, page_size, kv_token_base, first, kv_read_once, bad_page);
        if constexpr (T::kDecodeItems) load_kv_tile_tma<T>(smem, args, k_boxes, stage, free_phase, kv_head);
        constexpr int kVAhead = T::kDecodeItems ? 1 : T::kVStaging;  // tiles whose V rows one pass may request
        unrequested = max(unrequested, n);
        while (unrequested < num_tiles && unrequested - n < kVAhead &&
               tile_is_boxed<T>(args, w, page_size, tile_first<T>(w, unrequested))) {
          const int ahead = unrequested - n;
          const TileBoxes v_boxes = ahead == 0 ? k_boxes
                                               : tile_boxes<T>(args, page_ids, page_size, kv_token_base,
                                                               tile_first<T>(w, unrequested), kv_read_once, bad_page);
          const int staged = count.staged + ahead;
          if constexpr (T::kDecodeItems) {  // the buffer's last tile is transposed (fresh: released)
            Barrier::wait(&smem.v_rows_empty[staged % T::kVStaging], ((staged / T::kVStaging) & 1) ^ 1);
          }
          box_v_rows<T>(smem, args, v_boxes, staged % T::kVStaging, kv_head);
          ++unrequested;
        }
        if constexpr (!T::kDecodeItems) load_kv_tile_tma<T>(smem, args, k_boxes, stage, free_phase, kv_head);
        __syncwarp();  // lanes without boxes left early; ldmatrix and bar.sync below need the whole warp
        if (!by_consumer) transpose_staged_v<T>(smem, count.staged, stage, free_phase, tid, kBarrierProducer);
        ++count.staged;
      } else {
        const TileBoxes boxes = tile_boxes<T>(args, page_ids, page_size, kv_token_base, first, kv_read_once, bad_page);
        load_kv_tile_tma<T>(smem, args, boxes, stage, free_phase, kv_head);
        __syncwarp();  // lanes without boxes left early; the bar.sync of a gathered tile needs the whole warp
        if constexpr (T::kVtAhead) box_vt(first, stage, free_phase);
      }
      continue;
    }
    // Warps without boxes skipped the 16-bit boxed tiles (rather than spin on their barriers), so
    // they meet the others here before waiting on a stage barrier whose phase parity only then
    // means this tile; this also frees the page table's one slot.
    cutlass::arch::NamedBarrier::sync(T::kProducerThreads, kBarrierProducer);
    if constexpr (T::kPagedKV) {
      fill_page_table<T>(smem.page_rows, p, page_ids, page_size, first, w.end, tid, bad_page);
      cutlass::arch::NamedBarrier::sync(T::kProducerThreads, kBarrierProducer);
    }
    auto row_offset = [&](int64_t page_stride, int64_t token_stride) {
      return gathered_rows<T>(smem.page_rows, first, w.end, kv_token_base, page_stride, token_stride);
    };
    Barrier::wait(&smem.k_empty[stage], free_phase);
    load_kv_tile<T, T::kCellsQK>(k_smem, k_head, tid, row_offset(p.kv_stride_page, p.kv_stride_token), [&](int row, int cell) {
      return swizzled_offset<typename T::SmemLayoutK, typename T::Element>(row, cell * T::kCellElements, stage);
    });
    arrive_gathered(&smem.k_full[stage], tid);
    if constexpr (T::kVtAhead) {
      box_vt(first, stage, free_phase);
      continue;
    }
    Barrier::wait(&smem.v_empty[stage], free_phase);
    if constexpr (T::kFp8) {
      load_v_tile_transposed<T>(v_smem, v_head, tid, row_offset(p.v_stride_page, p.v_stride_token), stage);
      arrive_stored(&smem.v_full[stage], kBarrierProducer, tid);
    } else {
      load_kv_tile<T, T::kCellsVO>(v_smem, v_head, tid, row_offset(p.v_stride_page, p.v_stride_token), [&](int row, int cell) {
        return swizzled_offset<typename T::SmemLayoutVt, typename T::Element>(cell * T::kCellElements, row, stage);
      });
      arrive_gathered(&smem.v_full[stage], tid);
    }
  }
  if (!T::kClaimEarly || num_tiles <= T::kStages) claim_next();
  count.advance(num_tiles);
  report_item<T>(smem, plan, count.items++, bad_page, tid);
}

// ---------------------------------------------------------------------------------------------
// Consumer warpgroups

// A wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) viewed as (rows, cols): rows (2, MMA_M),
// cols (2, N/8, MMA_N). A thread's rows are shared with the 3 other lanes of its quad.
template <typename Layout>
__device__ __forceinline__ constexpr auto rowcol(Layout l) {
  using namespace cute;
  static_assert(decltype(rank<0>(l))::value == 3, "fa3: expects an sm90 wgmma accumulator layout");
  auto v = get<0>(l);
  return make_layout(make_layout(get<1>(v), get<1>(l)), make_layout(get<0>(v), get<2>(v), get<2>(l)));
}

// Which keys the rows see: a tile's keys from its `from` on (tile_first), then `end`, causality and
// the window cut.
template <typename T>
struct KeyMask {
  int end, pos_shift, window_left, q_pos_first, q_pos_last;
  bool causal;

  // Every row sees every key of the tile starting at `first` unless this says otherwise.
  __device__ __forceinline__ bool tile_needs_mask(int first, int from) const {
    const int last = first + T::kBlockN - 1;
    bool needs = first < from || last >= end || (causal && last > q_pos_first);
    if constexpr (T::kSlidingWindow) needs = needs || (window_left >= 0 && first < q_pos_last - window_left);
    return needs;
  }
  __device__ __forceinline__ bool visible(int key, int from, int q_pos) const {
    bool ok = key >= from && key < end && (!causal || key <= q_pos);
    if constexpr (T::kSlidingWindow) ok = ok && (window_left < 0 || key >= q_pos - window_left);
    return ok;
  }
};

// Each of the first kRows rows' max over the tile's columns and its lane quad. Four running
// maxima per row, seeded by the first four columns, the rows in one pass: eight independent FMNMX
// chains for two rows, and their shuffles overlap (one row after the other, ptxas kept them apart;
// e4m3 +1% in a same-run A/B).
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

// Pingpong (T::kPingpong): the consumer warpgroups take turns, in a ring, issuing their wgmma
// batches, so one's GEMMs run while the others do their softmax. Warpgroup w waits on barrier
// kBarrierScheduler + w; the issue of the warpgroup before it arrives on it. The last warpgroup
// opens each item's ring (so warpgroup 0 issues first) and skips its last pass, which balances
// every barrier per item. Without pingpong the calls are empty and each warpgroup issues when ready.
constexpr int kBarrierScheduler = 2;  // ids 2 .. 1 + warpgroups
template <typename T>
__device__ __forceinline__ void scheduler_wait(int wg) {
  if constexpr (T::kPingpong) cutlass::arch::NamedBarrier::sync(256, kBarrierScheduler + wg);
}
template <typename T>
__device__ __forceinline__ void scheduler_pass(int wg) {
  if constexpr (T::kPingpong) {
    cutlass::arch::NamedBarrier::arrive(256, kBarrierScheduler + (wg + 1) % T::kConsumerWarpgroups);
  }
}
template <typename T>
__device__ __forceinline__ void scheduler_open(int wg) {
  if (wg == T::kConsumerWarpgroups - 1) scheduler_pass<T>(wg);
}
template <typename T>
__device__ __forceinline__ void scheduler_close(int wg) {
  if (wg != T::kConsumerWarpgroups - 1) scheduler_pass<T>(wg);
}

// fp8 in-order warpgroups start each job in turn (T::kStaggeredStarts): warpgroup w > 0 issues its
// first Q K^T once warpgroup w - 1's is done. Warpgroup w waits on barrier kBarrierStagger +
// 2 (w - 1) + item % 2, which w - 1 arrives on: one per job parity, so that a warpgroup a job
// ahead (two Q buffers) could never arrive twice on a barrier its successor has not yet passed.
constexpr int kBarrierStagger = 2;  // ids 2 .. 5: in-order kernels have no pingpong and no transposer
template <typename T>
__device__ __forceinline__ void stagger_wait(int wg, int item) {
  static_assert(!T::kStaggeredStarts || (!T::kPingpong && !T::kDecodeItems),
                "fa3: the stagger barriers share their ids with pingpong's (2-4) and the transposer's (5)");
  if constexpr (T::kStaggeredStarts) {
    if (wg > 0) cutlass::arch::NamedBarrier::sync(256, kBarrierStagger + 2 * (wg - 1) + item % 2);
  }
}
template <typename T>
__device__ __forceinline__ void stagger_pass(int wg, int item) {
  if constexpr (T::kStaggeredStarts) {
    if (wg + 1 < T::kConsumerWarpgroups) cutlass::arch::NamedBarrier::arrive(256, kBarrierStagger + 2 * wg + item % 2);
  }
}

// fp8 per-head scales (float32; stride 0: one value for every head); none given reads as 1.
__device__ __forceinline__ float head_scale(const void* scales, int stride, int head) {
  return scales == nullptr ? 1.f : __ldg(static_cast<const float*>(scales) + head * stride);
}

// Within each quad (the four lanes that share a row of a wgmma accumulator), lane i's v[j] moves to
// lane j's v[i]: two butterfly exchanges, lanes 2 apart, then 1 apart.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4]) {
  const bool upper = threadIdx.x & 2, odd = threadIdx.x & 1;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? v[k] : v[k + 2], 2);
    if (upper) v[k] = got; else v[k + 2] = got;
  }
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? v[k] : v[k + 1], 1);
    if (odd) v[k] = got; else v[k + 1] = got;
  }
}

// One accumulator row of o, scaled by inv_d, stored as 16-byte vectors. A lane holds two columns of
// each 8-column block; after a quad transpose per four blocks, lane q holds all of block 4g + q, so
// one warp store writes 64 contiguous bytes of each of its 8 rows. With two-column stores (16 bytes
// a row, 4x the instructions) every job ended on a store tail that short jobs felt most: same-run
// A/B, bf16 hd 128, 16 x 1024 tokens +4..+6%, 64 x 256 +6..+11%, 4 x 4096 +1%.
template <typename DTypeO, typename TensorO, typename TensorC>
__device__ __forceinline__ void store_o_row(DTypeO* o_row, bool stored, float inv_d, int r, TensorO& o,
                                            TensorC& coord) {
  using namespace cute;
  static_assert(decltype(size<1>(o))::value % 8 == 0, "fa3 o store: whole groups of four 8-column blocks");
  const int q = threadIdx.x % 4;
#pragma unroll
  for (int g = 0; g < size<1>(o) / 8; ++g) {
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = common::pack2<DTypeO>(o(r, 8 * g + 2 * i) * inv_d, o(r, 8 * g + 2 * i + 1) * inv_d);
    quad_transpose(v);
    // (r, 8g) is this lane's first column of block 4g: 8 * 4g + 2q
    if (stored) *reinterpret_cast<uint4*>(o_row + get<1>(coord(r, 8 * g)) + 6 * q) = make_uint4(v[0], v[1], v[2], v[3]);
  }
}

// A row of the item on its way out: its token and qo head, its normalization (fp8: times the kv
// head's v scale) and lse, and where they go: o's row and lse (w.slot < 0), else the fp32 partial
// row and lse of the chunk.
template <typename T>
struct RowOutput {
  int token, qo_head;
  float inv_d, lse;

  __device__ __forceinline__ typename T::DTypeO* o_row(const typename T::Params& p, const WorkTile& w) const {
    return static_cast<typename T::DTypeO*>(p.o) + int64_t(w.qo_begin + token) * p.o_stride_n +
           int64_t(qo_head) * p.o_stride_h;
  }
  __device__ __forceinline__ float* lse_at(const typename T::Params& p, const WorkTile& w) const {
    return static_cast<float*>(p.lse) + int64_t(w.qo_begin + token) * p.num_qo_heads + qo_head;
  }
  __device__ __forceinline__ int64_t partial_row(const typename T::Params& p, const WorkTile& w, int num_chunks) const {
    return int64_t(w.slot + token * num_chunks) * p.num_qo_heads + qo_head;
  }
};

// What a job's rows share on their way out.
struct ItemOutput {
  int num_chunks;  // the request's (w.slot >= 0)
  float v_scale;
  bool bad_page;
};

template <typename T>
__device__ __forceinline__ ItemOutput item_output(const typename T::Params& p, const WorkTile& w, int kv_head,
                                                  bool bad_page) {
  return {w.slot >= 0 ? static_cast<const int32_t*>(p.plan)[p.off_num_chunks + w.request] : 0,
          T::kFp8 ? head_scale(p.v_scale, p.v_scale_stride, kv_head) : 1.f, bad_page};
}

template <typename T>
__device__ __forceinline__ RowOutput<T> row_output(const typename T::Params& p, const WorkTile& w,
                                                   const common::FastDivmod& group, int kv_head,
                                                   const ItemOutput& item, int row, float m, float d) {
  RowOutput<T> out;
  int head_in_group;
  group.divmod(w.row_begin + row, out.token, head_in_group);
  out.qo_head = kv_head * p.group_size + head_in_group;
  // The approximate division and log2 (MUFU.RCP, MUFU.LG2; d is a sum of weights below 2^9 each,
  // far from __fdividef's 2^126 limit) shorten the store's dependent chain: same-run A/Bs, bf16
  // hd 128, 4 x 4096 causal +2..+3%, 16 x 1024 +1..+3%, 64 x 256 non-causal +4%, long non-causal
  // within the spread. d is 0 exactly when the row saw no key; a NaN d (a NaN key or value read,
  // e.g. the NaN rows a bad page id leaves in pages gathered ahead) stays NaN in o and lse.
  out.inv_d = item.bad_page ? NAN : (d != 0.f ? __fdividef(item.v_scale, d) : 0.f);
  out.lse = item.bad_page ? NAN : (d != 0.f ? m + __log2f(d) - T::kPExponentOffset : common::kNegInf);
  return out;
}

// Normalize and store the thread's rows: o/lse directly, or the fp32 partial slot of the chunk.
// Every lane runs the quad exchanges, stored rows or not.
template <typename T, typename TensorO, typename TensorC>
__device__ __forceinline__ void store_rows(const typename T::Params& p, const WorkTile& w,
                                           const common::FastDivmod& group, int kv_head, bool bad_page,
                                           const float (&m)[2], const float (&d)[2], TensorO& o, TensorC& coord) {
  using namespace cute;
  const int lane = threadIdx.x % 32;
  const ItemOutput item = item_output<T>(p, w, kv_head, bad_page);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = get<0>(coord(r, 0));
    const bool stored = row < w.rows;
    const RowOutput<T> out = row_output<T>(p, w, group, kv_head, item, row, m[r], d[r]);
    if (w.slot < 0) {
      store_o_row(out.o_row(p, w), stored, out.inv_d, r, o, coord);
      if (stored && p.lse != nullptr && lane % 4 == 0) *out.lse_at(p, w) = out.lse;
    } else if (stored) {
      const int64_t prow = out.partial_row(p, w, item.num_chunks);
      float* partial = static_cast<float*>(p.tmp_v) + prow * T::kHeadDimVO;
#pragma unroll
      for (int c = 0; c < size<1>(o); c += 2) {
        *reinterpret_cast<float2*>(partial + get<1>(coord(r, c))) = make_float2(o(r, c) * out.inv_d, o(r, c + 1) * out.inv_d);
      }
      if (lane % 4 == 0) static_cast<float*>(p.tmp_s)[prow] = out.lse;
    }
  }
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

template <typename T>
__device__ __forceinline__ KeyMask<T> key_mask(const typename T::Params& p, const WorkTile& w) {
  return {w.end, w.pos_shift, p.window_left, w.first_token + w.pos_shift, w.last_token + w.pos_shift, p.causal != 0};
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

// The consumer loop of `consume` with nothing but its barrier and pingpong traffic, in the same
// order, for a warpgroup with no rows to compute; for decode items (consumer_transposes) also
// each boxed V tile's transpose at the top of its iteration, as the producer would do it: its rows
// and its stage's release awaited, then v_full and the staging buffer's release.
template <typename T>
__device__ __forceinline__ void follow_pipeline(typename T::SharedStorage& smem, const KernelArgs<T>& args,
                                                const WorkTile& w, const PipelineCount<T::kStages>& count,
                                                int num_tiles, int wg) {
  using Barrier = cutlass::arch::ClusterBarrier;
  int staged = count.staged;
  // Warpgroup 1 alone: with both warpgroups following (an item of no rows, which the planner never
  // makes), two transposers would arrive on each tile's barriers.
  const bool transposes = wg == 1 && consumer_transposes<T>(w);
  const common::FastDivmod page_size(T::kPagedKV ? args.p.page_size : 1);
  auto transpose = [&](int n) {
    if constexpr (T::kDecodeItems) {
      if (!transposes || !tile_is_boxed<T>(args, w, page_size, tile_first<T>(w, n))) return;
      const int tid = int(threadIdx.x) - T::kProducerThreads - 128 * wg;
      transpose_staged_v<T>(smem, staged, count.stage(n), count.phase(n) ^ 1, tid, kBarrierTransposer);
      ++staged;
    }
  };
  scheduler_open<T>(wg);
  stagger_wait<T>(wg, count.items);
  stagger_pass<T>(wg, count.items);
  const QBuffer<T> q = q_buffer<T>(smem, count.items);
  Barrier::wait(q.full, q.phase);
  Barrier::arrive(q.empty);
  transpose(0);
  Barrier::wait(&smem.k_full[count.stage(0)], count.phase(0));
  scheduler_wait<T>(wg);
  scheduler_pass<T>(wg);
  Barrier::arrive(&smem.k_empty[count.stage(0)]);
  for (int n = 1; n < num_tiles; ++n) {
    transpose(n);
    const int stage = count.stage(n), prev = count.stage(n - 1);
    Barrier::wait(&smem.k_full[stage], count.phase(n));
    Barrier::wait(&smem.v_full[prev], count.phase(n - 1));
    scheduler_wait<T>(wg);
    scheduler_pass<T>(wg);
    Barrier::arrive(&smem.k_empty[stage]);
    Barrier::arrive(&smem.v_empty[prev]);
  }
  const int last = count.stage(num_tiles - 1);
  Barrier::wait(&smem.v_full[last], count.phase(num_tiles - 1));
  scheduler_wait<T>(wg);
  scheduler_close<T>(wg);
  Barrier::arrive(&smem.v_empty[last]);
}

// A consumer warpgroup at the end of a job with kv tiles: the pipeline's counts move past the item
// (in decode items also the staging buffers its boxed tiles took), and the producer's verdict on
// its page ids, once it has seen them all: whether the job's rows come out NaN.
template <typename T>
__device__ __forceinline__ bool end_item(typename T::SharedStorage& smem, const KernelArgs<T>& args, const WorkTile& w,
                                         PipelineCount<T::kStages>& count, int num_tiles) {
  const int item = count.items++;
  count.advance(num_tiles);
  cutlass::arch::ClusterBarrier::wait(&smem.item_done[item % 2], (item / 2) & 1);
  if constexpr (T::kDecodeItems) count.staged += num_boxed_tiles<T>(args, w, common::FastDivmod(args.p.page_size), num_tiles);
  return smem.item_bad_page[item % 2] != 0;
}

// x, which every lane of the warp holds, in a uniform register: redux.sync writes one, so the wgmma
// descriptors derived from it stay on the uniform datapath instead of being built per thread and
// moved over (R2UR) for every wgmma of every tile.
__device__ __forceinline__ int warp_uniform(int x) { return __reduce_max_sync(0xffffffffu, x); }

// A K/V tile's stage is ready for the wgmma: its barrier passed, and the generic-proxy writes of a
// gathered tile (cp.async) made visible to the async proxy: always, unless the caller knows the
// tile came by TMA (GatheredOperands).
__device__ __forceinline__ void wait_tile(uint64_t* full, uint32_t phase, bool gathered = true) {
  cutlass::arch::ClusterBarrier::wait(full, phase);
  if (gathered) cutlass::arch::fence_view_async_shared();
}

// Which of an fp8 in-order job's shared-memory operands cp.async wrote (generic proxy), whose
// completion the consumer learns from the barrier and must fence before its wgmma reads them: a
// gathered Q, and the K of the item's tiles from `first_gathered` on (every tile, the last, or
// none) that tile_is_boxed refuses (paged: every tile where some may straddle a page). TMA tiles
// need no fence, nor fp8 V, whose transposing threads fence their own stores (arrive_stored).
// The fence (MEMBAR and FENCE.VIEW.ASYNC in the SASS) before each tile's two wgmma batches cost
// the in-order fp8 loop 1-3% (design notes, twenty-fifth session). 16-bit kernels fence every
// tile as before: their tighter in-order loop ran 1-3% slower without (ptxas schedules it
// differently; a per-tile test made it serialize the wgmmas, C7512).
template <typename T>
struct GatheredOperands {
  bool q_gathered;
  int first_gathered;

  // 16-bit kernels fence every K tile before its Q K^T, which covers a gathered Q as well.
  __device__ __forceinline__ bool q() const { return T::kFp8 && q_gathered; }
  __device__ __forceinline__ bool k(int n) const {
    if constexpr (!T::kFp8) return true;
    // Ragged with V transposed ahead: the tensor holds a tile at least (launch_prefill), so
    // every tile is one box.
    if constexpr (T::kVtAhead && !T::kPagedKV) return false;
    return n >= first_gathered;
  }
  __device__ __forceinline__ bool v(int) const { return !T::kFp8; }
};
template <typename T>
__device__ __forceinline__ GatheredOperands<T> gathered_operands(const KernelArgs<T>& args, const WorkTile& w,
                                                                 int num_tiles) {
  const bool q_gathered = !args.q_boxed;
  if (args.box_rows == 0) return {q_gathered, 0};
  // Ragged: a tile is a box unless the request is shorter than one (tile_first).
  if constexpr (!T::kPagedKV) return {q_gathered, w.end < T::kBlockN ? 0 : num_tiles};
  // Paged, tiles kBlockN apart from the first: pages that divide a tile leave every tile where the
  // first begins in its page, and a tile-aligned first in pages of whole tiles never straddles;
  // otherwise only the last tile, where it holds w.end, is gathered.
  const int page_size = args.p.page_size, first = tile_first<T>(w, 0);
  const bool straddle = page_size <= T::kBlockN ? first % page_size != 0
                                               : page_size % T::kBlockN != 0 || first % T::kBlockN != 0;
  if (straddle) return {q_gathered, 0};
  return {q_gathered, tile_first<T>(w, num_tiles - 1) + T::kBlockN > w.end ? num_tiles - 1 : num_tiles};
}

// A computing consumer warpgroup's kv loop, whichever operand runs along M (FA3's intra-warpgroup
// overlap): iteration n issues S_n (issue_s(stage)) and O += P_{n-1} V_{n-1} (issue_o(stage, n - 1))
// together, runs the softmax of S_n (softmax(n, alpha)) while the P.V wgmma is in flight, and only
// then rescales O (rescale(alpha)) and makes P_n its next A or B operand (to_p()). Q is released
// once the item's last S is computed, so the producer can load the next item's while this one
// finishes. Each wgmma wait is followed by its accumulator's register fence (s_acc, o_acc).
template <typename T, typename TensorS, typename TensorO, typename IssueS, typename IssueO, typename Softmax,
          typename Rescale, typename ToP>
__device__ __forceinline__ void run_kv_tiles(typename T::SharedStorage& smem, const PipelineCount<T::kStages>& count,
                                             int num_tiles, int wg, TensorS& s_acc, TensorO& o_acc, IssueS issue_s,
                                             IssueO issue_o, Softmax softmax, Rescale rescale, ToP to_p) {
  using namespace cute;
  using Barrier = cutlass::arch::ClusterBarrier;
  float alpha[2];
  scheduler_open<T>(wg);  // warpgroup 0 issues first
  const QBuffer<T> q = q_buffer<T>(smem, count.items);
  Barrier::wait(q.full, q.phase);
  wait_tile(&smem.k_full[count.stage(0)], count.phase(0));
  scheduler_wait<T>(wg);
  issue_s(count.stage(0));
  scheduler_pass<T>(wg);
  warpgroup_wait<0>();
  warpgroup_fence_operand(s_acc);
  Barrier::arrive(&smem.k_empty[count.stage(0)]);
  if (num_tiles == 1) Barrier::arrive(q.empty);
  softmax(0, alpha);  // o is still zero: no rescale
  to_p();
  if (num_tiles > 1) wait_tile(&smem.k_full[count.stage(1)], count.phase(1));

  for (int n = 1; n < num_tiles; ++n) {
    const int stage = warp_uniform(count.stage(n)), prev = warp_uniform(count.stage(n - 1));
    wait_tile(&smem.v_full[prev], count.phase(n - 1));
    scheduler_wait<T>(wg);
    issue_s(stage);
    issue_o(prev, n - 1);
    scheduler_pass<T>(wg);
    warpgroup_wait<1>();  // S_n is ready; P_{n-1} V_{n-1} may still run
    warpgroup_fence_operand(s_acc);
    Barrier::arrive(&smem.k_empty[stage]);
    if (n + 1 == num_tiles) Barrier::arrive(q.empty);
    softmax(n, alpha);
    // The next K tile's wait sits between the softmax and the P.V wait on purpose: ptxas keeps
    // a wgmma wait inside its basic block but hoists it to the block's top, where it would
    // serialize the softmax behind the P.V wgmma; the wait loop is a block boundary.
    if (n + 1 < num_tiles) wait_tile(&smem.k_full[count.stage(n + 1)], count.phase(n + 1));
    warpgroup_wait<0>();
    warpgroup_fence_operand(o_acc);
    Barrier::arrive(&smem.v_empty[prev]);
    rescale(alpha);
    to_p();
  }

  const int last = count.stage(num_tiles - 1);
  wait_tile(&smem.v_full[last], count.phase(num_tiles - 1));
  scheduler_wait<T>(wg);
  issue_o(last, num_tiles - 1);
  scheduler_close<T>(wg);
  warpgroup_wait<0>();
  warpgroup_fence_operand(o_acc);
  Barrier::arrive(&smem.v_empty[last]);
}

// A computing consumer warpgroup's kv loop in order (T::kInOrder): tile n's S, its scores weighed
// (weigh(n, alpha): scaled, masked, the rows' max moved), o's rescale, then P.V in T::kPVParts parts
// of the tile's keys, waited for before S_{n+1} is issued: part k's weights (to_p(k)) are
// computed while part k - 1's wgmmas run (issue_o(stage, k)). The warpgroup never holds S, P and o
// for the wgmmas at once, so three fit beside each other, and the other warpgroups' GEMMs and
// softmaxes fill each one's waits.
template <typename T, typename TensorS, typename TensorO, typename IssueS, typename IssueO, typename Weigh,
          typename Rescale, typename ToP>
__device__ __forceinline__ void run_kv_tiles_in_order(typename T::SharedStorage& smem,
                                                      const PipelineCount<T::kStages>& count, int num_tiles, int wg,
                                                      const GatheredOperands<T>& gathered, TensorS& s_acc,
                                                      TensorO& o_acc, IssueS issue_s, IssueO issue_o, Weigh weigh,
                                                      Rescale rescale, ToP to_p) {
  using Barrier = cutlass::arch::ClusterBarrier;
  float alpha[2];
  const QBuffer<T> q = q_buffer<T>(smem, count.items);
  Barrier::wait(q.full, q.phase);
  if (gathered.q()) cutlass::arch::fence_view_async_shared();
  stagger_wait<T>(wg, count.items);
  // Tile n; the first (kFirst) lets the next warpgroup start (stagger_pass) once its S is done.
  // Inlined up front: as a plain lambda the loop compiled differently (16-bit kernels' SASS
  // changed, and the peeled fp8 loop ran 3.5-4% slower at 1 x 16384, 2% at 4 x 4096).
  auto run_tile = [&](int n, auto kFirst) __attribute__((always_inline)) {
    const int stage = warp_uniform(count.stage(n));
    wait_tile(&smem.k_full[stage], count.phase(n), gathered.k(n));
    issue_s(stage);
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(s_acc);
    Barrier::arrive(&smem.k_empty[stage]);
    if (n + 1 == num_tiles) Barrier::arrive(q.empty);
    if constexpr (decltype(kFirst)::value) stagger_pass<T>(wg, count.items);
    weigh(n, alpha);
    rescale(alpha);
    cute::for_each(cute::make_seq<T::kPVParts>{}, [&](auto part) {
      to_p(part);
      if constexpr (decltype(part)::value == 0) wait_tile(&smem.v_full[stage], count.phase(n), gathered.v(n));
      issue_o(stage, part);
    });
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(o_acc);
    Barrier::arrive(&smem.v_empty[stage]);
  };
  // Starts in turn peel the first tile off, so the later ones carry no test for it, and the freed
  // registers keep Q's descriptors out of local memory. Same-run A/B, e4m3 hd 128 (design notes,
  // twenty-sixth session): 4 x 4096 +2.7..+3.8%, 1 x 16384 +2.3..+4.3%, 16 x 1024 +0..+3.7%.
  // 16-bit kernels keep one loop (their SASS unchanged): peeled, ptxas serialized their wgmmas
  // (C7512).
  if constexpr (T::kStaggeredStarts) {
    run_tile(0, std::true_type{});
    for (int n = 1; n < num_tiles; ++n) run_tile(n, std::false_type{});
  } else {
    for (int n = 0; n < num_tiles; ++n) run_tile(n, std::false_type{});
  }
}

// ---------------------------------------------------------------------------------------------
// Decode items of at most 8 rows: the keys along M (T::kKeysAlongM)
//
// A decode item's rows are its request's GQA group, 1 to 8 of a 64-row wgmma's, and warpgroup 0's
// chain per tile (two 64 x 128 x 128 wgmmas and the softmax) bounded the decode kernel: with its
// math taken out the kernel ran 11% faster (design notes). Swapped, a tile's 128 keys are the M of
// two 64-row wgmmas and the item's rows the N (8):
//   S^T = K Q^T    (A: the K tile, B: Q's first 8 rows; both K-major as they lie),
//   O^T += V^T P^T (A: the transposed V tile, B: P^T, which the softmax writes to shared memory
//                   in V^T's key order),
// an eighth of the tensor work and of the exp2s (same-run A/B, e4m3, batch 64 x kv 4096, page 16:
// 157 -> 149 us at group 1, 162-171 -> 150 at group 4, 161 -> 151 at group 8). A thread holds 2 rows x 4 keys of S^T and 2 rows x
// 4 dims of O^T (its rows 2 (l % 4) and + 1 of every accumulator's 8 columns); a row's max and sum
// over a tile run over the 8 lanes that share its rows and across the 4 warps through shared
// memory (across_warps), and P^T's writes meet on the same named barrier before the P.V wgmma.
// Consumer warpgroup 1 transposes V as in the other decode items.
constexpr int kBarrierKeysAlongM = 6;  // warpgroup 0 among itself

// The slot of P's key k in V^T's order: the inverse of p_key_of_slot.
__host__ __device__ constexpr int slot_of_p_key(int key) {
  const int r = key % 16;
  return key / 16 * 16 + 4 * (r % 8 / 2) + 2 * (r / 8) + r % 2;
}
constexpr bool slot_of_p_key_inverts() {
  for (int slot = 0; slot < 32; ++slot) {
    if (slot_of_p_key(p_key_of_slot(slot)) != slot) return false;
  }
  return true;
}
static_assert(slot_of_p_key_inverts(), "fa3: slot_of_p_key must invert p_key_of_slot");

template <typename T>
struct KeysAlongM {
  using Element = typename T::Element;
  using ElementP = typename T::ElementP;
  using TiledMmaKQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::_8, cute::Int<T::kHeadDimQK>>>()));
  using TiledMmaVP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, ElementP, float, cute::Shape<cute::_64, cute::_8, cute::Int<T::kBlockN>>>()));
  // P^T of tiles n % 2: 8 rows of kBlockN keys, K-major.
  using SmemLayoutP = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<ElementP>{},
                                                   cute::Shape<cute::_8, cute::Int<T::kBlockN>, cute::_2>{}));
};

// A swapped accumulator as (the item's rows, the thread's M values): rowcol with its modes exchanged.
template <typename Layout>
__device__ __forceinline__ constexpr auto colrow(Layout l) {
  const auto rc = rowcol(l);
  return cute::make_layout(cute::get<1>(rc), cute::get<0>(rc));
}

// The thread's two rows' values combined (max or sum) with the other warps' of warpgroup 0, whose
// lanes l % 4 hold the same rows. `exchange`: T::kExchangeFloats of shared memory no thread may still
// be reading from an earlier call (a named barrier of warpgroup 0 lies between).
template <typename Combine>
__device__ __forceinline__ void across_warps(float* exchange, const int (&rows)[2], float (&x)[2], Combine combine) {
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  if (lane < 4) {
#pragma unroll
    for (int r = 0; r < 2; ++r) exchange[8 * warp + rows[r]] = x[r];
  }
  cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrierKeysAlongM);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float* at = exchange + rows[r];
    x[r] = combine(combine(at[0], at[8]), combine(at[16], at[24]));
  }
}

// The thread's stored rows of O^T, normalized: to o and lse, or the chunk's partial rows. Its 4
// dims of a row lie 8 apart or more: single stores (at a job's end only).
template <typename T, typename TensorO, typename TensorC>
__device__ __forceinline__ void store_rows_keys_along_m(const typename T::Params& p, const WorkTile& w,
                                                        const common::FastDivmod& group, int kv_head, bool bad_page,
                                                        const int (&rows)[2], const float (&m)[2],
                                                        const float (&d)[2], TensorO& o, TensorC& coord) {
  using namespace cute;
  using DTypeO = typename T::DTypeO;
  const ItemOutput item = item_output<T>(p, w, kv_head, bad_page);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= w.rows) continue;
    const RowOutput<T> out = row_output<T>(p, w, group, kv_head, item, rows[r], m[r], d[r]);
    // Every warp holds the row's m and d: warp 0's lanes 0-3 write its lse.
    const bool writes_lse = threadIdx.x % cutlass::NumThreadsPerWarpGroup < 4;
    if (w.slot < 0) {
      DTypeO* o_row = out.o_row(p, w);
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o_row[get<0>(coord(r, c))] = DTypeO(o(r, c) * out.inv_d);
      if (writes_lse && p.lse != nullptr) *out.lse_at(p, w) = out.lse;
    } else {
      const int64_t prow = out.partial_row(p, w, item.num_chunks);
      float* partial = static_cast<float*>(p.tmp_v) + prow * T::kHeadDimVO;
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) partial[get<0>(coord(r, c))] = o(r, c) * out.inv_d;
      if (writes_lse) static_cast<float*>(p.tmp_s)[prow] = out.lse;
    }
  }
}

// Warpgroup 0's part of a decode item of at most 8 rows (warpgroup 1 follows the pipeline and
// transposes V): the kv loop of every computing warpgroup (run_kv_tiles).
template <typename T>
__device__ __forceinline__ void consume_keys_along_m(typename T::SharedStorage& smem, const KernelArgs<T>& args,
                                                     const JobSlot& job, const common::FastDivmod& group,
                                                     PipelineCount<T::kStages>& count) {
  using namespace cute;
  using Swapped = KeysAlongM<T>;
  const auto& p = args.p;
  const int tid = threadIdx.x - T::kProducerThreads;
  const int kv_head = job.kv_head;
  const WorkTile w = job.work;

  typename Swapped::TiledMmaKQ mma_kq;
  typename Swapped::TiledMmaVP mma_vp;
  // Shared operands' descriptors are the same for every thread: partitioned for thread 0, uniform.
  auto operands_kq = mma_kq.get_thread_slice(0);
  auto operands_vp = mma_vp.get_thread_slice(0);
  Tensor sQ = make_tensor(make_smem_ptr(q_buffer<T>(smem, count.items).tile), typename T::SmemLayoutQ{});
  Tensor tSrK = operands_kq.partition_fragment_A(make_tensor(make_smem_ptr(smem.k), typename T::SmemLayoutK{}));
  Tensor tSrQ = operands_kq.partition_fragment_B(local_tile(sQ, Shape<_8, Int<T::kHeadDimQK>>{}, make_coord(0, 0)));
  Tensor tOrV = operands_vp.partition_fragment_A(make_tensor(make_smem_ptr(smem.v), typename T::SmemLayoutVt{}));
  Tensor tOrP = operands_vp.partition_fragment_B(make_tensor(make_smem_ptr(smem.p), typename Swapped::SmemLayoutP{}));
  Tensor tSrS = partition_fragment_C(mma_kq, Shape<Int<T::kBlockN>, _8>{});
  Tensor tOrO = partition_fragment_C(mma_vp, Shape<Int<T::kHeadDimVO>, _8>{});
  Tensor s = make_tensor(tSrS.data(), colrow(tSrS.layout()));
  Tensor o = make_tensor(tOrO.data(), colrow(tOrO.layout()));
  Tensor cS = mma_kq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, _8>{}));
  Tensor s_coord = make_tensor(cS.data(), colrow(cS.layout()));  // (key, row)
  Tensor cO = mma_vp.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<T::kHeadDimVO>, _8>{}));
  Tensor o_coord = make_tensor(cO.data(), colrow(cO.layout()));  // (dim, row)
  static_assert(decltype(size<0>(s))::value == 2 && decltype(size<1>(s))::value == 4,
                "fa3 keys along M: a thread holds 2 rows x 4 keys of a 128-key tile");

  float m[2] = {common::kNegInf, common::kNegInf};
  float d[2] = {0.f, 0.f};
  clear(tOrO);
  int rows[2], q_pos[2];
  float score_scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rows[r] = get<1>(s_coord(r, 0));
    row_factors<T>(p, w, group, kv_head, rows[r], q_pos[r], score_scale[r]);
  }
  const KeyMask<T> mask = key_mask<T>(p, w);
  const int num_tiles = num_kv_tiles<T>(w);
  if (num_tiles == 0) {  // the producer skipped the item: nothing to wait for
    store_rows_keys_along_m<T>(p, w, group, kv_head, false, rows, m, d, o, o_coord);
    return;
  }

  auto issue_kq = [&](int stage) {
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_kq.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int kb = 0; kb < size<2>(tSrK); ++kb) {
      gemm(mma_kq, tSrK(_, _, kb, stage), tSrQ(_, _, kb), tSrS);
      mma_kq.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  auto issue_vp = [&](int stage, int n) {  // P^T of tile n is in buffer n % 2
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < size<2>(tOrV); ++kb) gemm(mma_vp, tOrV(_, _, kb, stage), tOrP(_, _, kb, n % 2), tOrO);
    warpgroup_commit_batch();
  };
  // Tile n's scores to weights in place, its o rescale factors into alpha, and P^T of the tile
  // written (buffer n % 2, whose last reader, the P.V wgmma of tile n - 2, every warp has waited
  // for before the tile's first barrier).
  auto softmax_tile = [&](int n, float (&alpha)[2]) {
    const int first = tile_first<T>(w, n), from = tile_from<T>(w, n);
    float scale[2];
    transform_scores<T>(p, mask, mask.tile_needs_mask(first, from), first, from, q_pos, score_scale, s,
                        [&](int r, int c) { return get<0>(s_coord(r, c)); }, scale);
    float row_max[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[r] = common::lane_group_max<8, 4>(fmaxf(fmaxf(s(r, 0), s(r, 1)), fmaxf(s(r, 2), s(r, 3))));
    }
    across_warps(smem.row_exchange + n % 2 * T::kExchangeFloats, rows, row_max,
                 [](float a, float b) { return fmaxf(a, b); });
    constexpr bool kLive[2] = {true, true};
    softmax_rows(s, row_max, m, d, scale, T::kPExponentOffset, T::kMaxLag, kLive, alpha);
    auto* p_bytes = reinterpret_cast<__nv_fp8_storage_t*>(smem.p);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        p_bytes[swizzled_offset<typename Swapped::SmemLayoutP, typename T::ElementP>(
            rows[r], slot_of_p_key(get<0>(s_coord(r, c))), n % 2)] = __nv_cvt_float_to_fp8(s(r, c), __NV_SATFINITE, __NV_E4M3);
      }
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kBarrierKeysAlongM);
  };

  run_kv_tiles<T>(smem, count, num_tiles, 0, tSrS, tOrO, issue_kq, issue_vp, softmax_tile,
                  [&](const float (&alpha)[2]) { rescale_rows(o, alpha); }, [] {});

#pragma unroll
  for (int r = 0; r < 2; ++r) d[r] = common::lane_group_sum<8, 4>(d[r]);
  // The sums' own slots: the next job's first maxima may be exchanged before every warp read these.
  across_warps(smem.row_exchange + 2 * T::kExchangeFloats, rows, d, [](float a, float b) { return a + b; });
  const WorkTile stored_w = job.work;
  const bool bad_page = end_item<T>(smem, args, stored_w, count, num_tiles);
  store_rows_keys_along_m<T>(p, stored_w, group, kv_head, bad_page, rows, m, d, o, o_coord);
}

// A consumer warpgroup's part of a job, the item's rows along the wgmmas' M.
template <typename T>
__device__ __forceinline__ void consume_rows_along_m(typename T::SharedStorage& smem, const KernelArgs<T>& args,
                                                     const JobSlot& job, const common::FastDivmod& group,
                                                     PipelineCount<T::kStages>& count) {
  using namespace cute;
  using Element = typename T::Element;
  const auto& p = args.p;
  const int ctid = threadIdx.x - T::kProducerThreads;  // across all consumer warpgroups
  const int kv_head = job.kv_head;
  const WorkTile w = job.work;

  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ctid);
  auto thr_pv = mma_pv.get_thread_slice(ctid);
  // Q's descriptors depend on the warpgroup and the job's Q buffer alone: from a uniform first
  // thread and buffer, they are uniform.
  const int warpgroup_base = warp_uniform(ctid) / 128 * 128;
  Element* const q_smem = q_buffer<T>(smem, warp_uniform(count.items)).tile;
  Tensor sK = make_tensor(make_smem_ptr(smem.k), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v), typename T::SmemLayoutVt{});
  Tensor tSrK = thr_qk.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<T::kBlockM>, Int<T::kHeadDimVO>>{});
  Tensor o = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
  Tensor s_coord = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kHeadDimVO>>{}));
  Tensor o_coord = make_tensor(cO.data(), rowcol(cO.layout()));

  float m[2] = {common::kNegInf, common::kNegInf};
  float d[2] = {0.f, 0.f};
  clear(tOrO);
  int q_pos[2];
  float score_scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) row_factors<T>(p, w, group, kv_head, get<0>(s_coord(r, 0)), q_pos[r], score_scale[r]);
  const KeyMask<T> mask = key_mask<T>(p, w);

  const int wg = ctid / 128;
  auto issue_qk = [&](auto& s_acc, int stage) {
    // Q's descriptors, (MMA, MMA_M, MMA_K), from the warpgroup's uniform first thread: built per
    // thread they took ordinary registers through the kv loop (two per 16 dims) and an R2UR per
    // wgmma, and made the hd 256 consumers spill.
    Tensor tSrQ = mma_qk.get_thread_slice(warpgroup_base)
                      .partition_fragment_A(make_tensor(make_smem_ptr(q_smem), typename T::SmemLayoutQ{}));
    static_assert(decltype(size<1>(tSrQ))::value == 1, "fa3: one 64-row wgmma per consumer warpgroup");
    warpgroup_fence_operand(s_acc);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      gemm(mma_qk, tSrQ(_, _, kb), tSrK(_, _, kb, stage), s_acc);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // P.V over part `part` of the tile's keys (of T::kPVParts), one wgmma batch.
  auto issue_pv = [&](auto& p_frag, int stage, auto part) {
    constexpr int kBlocks = decltype(size<2>(p_frag))::value / T::kPVParts;
    constexpr int kBegin = decltype(part)::value * kBlocks;
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
#pragma unroll
    for (int kb = kBegin; kb < kBegin + kBlocks; ++kb) gemm(mma_pv, p_frag(_, _, kb), tOrV(_, _, kb, stage), tOrO);
    warpgroup_commit_batch();
  };
  // Which of the thread's two rows (r: rows 8 apart) some stored row can be among, alike in the
  // whole warp. A decode item's group fills a few rows of warp 0 (group 4: rows 0-3), and skipping
  // the rest halves warp 0's softmax and frees warps 1-3's issue slots for the producer and the
  // transposing warpgroup. Prefill tiles keep every row (no per-tile test).
  bool live[2] = {true, true};
  if constexpr (T::kDecodeItems) {
    const int warp_first_row = warp_uniform(ctid) / 32 * 16;  // the warp's 16 rows of the CTA's tile
    for (int r = 0; r < 2; ++r) live[r] = warp_first_row + 8 * r < w.rows;
  }

  const int num_tiles = num_kv_tiles<T>(w);
  if (num_tiles == 0) {  // the producer skipped the item: nothing to wait for
    store_rows<T>(p, w, group, kv_head, false, m, d, o, o_coord);
    return;
  }
  // A warpgroup whose 64 rows all lie past the tile's rows (decode, a request's last q tile) runs
  // no GEMM: it only keeps the barrier and pingpong counts (a branch around the wgmma issue
  // itself would make ptxas serialize every wgmma).
  if (wg * 64 >= w.rows) {
    follow_pipeline<T>(smem, args, w, count, num_tiles, wg);
  } else {
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<T::kBlockM>, Int<T::kBlockN>>{});
    Tensor tOrP = make_tensor<typename T::ElementP>(typename T::FragmentPShape{});
    if constexpr (T::kDecodeItems) clear(tOrP);  // rows never live keep these zeros
    Tensor s = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
    float scale[2], neg_m[2];  // the current tile's, from weigh to exponentiate_scores
    // Tile n's scores scaled and masked in place and the rows' max moved: o's rescale factors in
    // alpha, and in scale and neg_m what exponentiate_scores makes the scores' weights with.
    auto weigh = [&](int n, float (&alpha)[2]) {
      const int first = tile_first<T>(w, n), from = tile_from<T>(w, n);
      transform_scores<T>(p, mask, mask.tile_needs_mask(first, from), first, from, q_pos, score_scale, s,
                          [&](int r, int c) { return get<1>(s_coord(r, c)); }, scale);
      float row_max[2];
      row_maxima(s, live, row_max);
      move_row_max(row_max, m, d, scale, T::kPExponentOffset, T::kMaxLag, live, alpha, neg_m);
    };
    // Part `part` of the tile's keys (of T::kPVParts): their scores to weights, the weights to P.
    auto to_weights = [&](auto part) {
      constexpr int kCols = decltype(size<1>(s))::value / T::kPVParts, kBegin = decltype(part)::value * kCols;
      exponentiate_scores<kBegin, kBegin + kCols>(s, scale, neg_m, live, d);
    };
    auto to_p = [&](auto part) { convert_p<T, decltype(part)::value, T::kPVParts>(tSrS, tOrP, live); };
    auto issue_s = [&](int stage) { issue_qk(tSrS, stage); };
    // A warp's 16 rows rarely all keep their max in the first tiles, and almost always after.
    auto rescale = [&](const float (&alpha)[2]) {
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale_rows(o, alpha);
    };
    if constexpr (T::kInOrder) {
      run_kv_tiles_in_order<T>(
          smem, count, num_tiles, wg, gathered_operands<T>(args, w, num_tiles), tSrS, tOrO, issue_s,
          [&](int stage, auto part) { issue_pv(tOrP, stage, part); }, weigh, rescale, [&](auto part) {
            to_weights(part);
            to_p(part);
          });
    } else {  // P_n replaces P_{n-1} only once the P.V wgmma reading it has finished
      static_assert(T::kPVParts == 1, "fa3: the overlapping kv loop converts P whole");
      constexpr cute::Int<0> kWhole{};
      run_kv_tiles<T>(
          smem, count, num_tiles, wg, tSrS, tOrO, issue_s, [&](int stage, int) { issue_pv(tOrP, stage, kWhole); },
          [&](int n, float (&alpha)[2]) {
            weigh(n, alpha);
            to_weights(kWhole);
          },
          rescale, [&] { to_p(kWhole); });
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) d[r] = common::lane_group_sum<4>(d[r]);
  // The job's rows, read again from its slot: kept, they would hold registers through the kv loop.
  const WorkTile stored_w = job.work;
  const bool bad_page = end_item<T>(smem, args, stored_w, count, num_tiles);
  store_rows<T>(p, stored_w, group, job.kv_head, bad_page, m, d, o, o_coord);
}

template <typename T>
__device__ __forceinline__ void consume(typename T::SharedStorage& smem, const KernelArgs<T>& args, const JobSlot& job,
                                        const common::FastDivmod& group, PipelineCount<T::kStages>& count) {
  if constexpr (T::kKeysAlongM) {
    if (threadIdx.x - T::kProducerThreads < cutlass::NumThreadsPerWarpGroup) {
      consume_keys_along_m<T>(smem, args, job, group, count);
      return;
    }
    // Warpgroup 1 has no rows: it transposes V and keeps the counts.
    const int num_tiles = num_kv_tiles<T>(job.work);
    if (num_tiles == 0) return;
    follow_pipeline<T>(smem, args, job.work, count, num_tiles, 1);
    end_item<T>(smem, args, job.work, count, num_tiles);
  } else {
    consume_rows_along_m<T>(smem, args, job, group, count);
  }
}

// Dynamic persistent schedule: a CTA's first job is its blockIdx.x, each next one the first not
// yet taken (the plan's counter, counted past the first grid's), so every SM takes its next job
// as it goes (kClaimEarly), longest first (the plan's order). Each job is taken once, so the counter
// ends at num_jobs: whoever takes its last value puts it back to 0 for the next launch (a CUDA
// graph replays it as is).
__device__ __forceinline__ int next_job(int32_t* plan, int num_jobs) {
  const int first_grid = min(int(gridDim.x), num_jobs);
  const int taken = atomicAdd(&plan[common::kPlanJobCounter], 1);
  if (taken == num_jobs - 1) atomicExch(&plan[common::kPlanJobCounter], 0);
  return first_grid + taken;
}

template <typename T>
__device__ __forceinline__ JobSlot job_slot(const typename T::Params& p, const common::FastDivmod& group, int job) {
  JobSlot slot{job, 0, {}};
  if (job < num_jobs_of(p)) {
    const Job j = job_of(p, job);
    slot.kv_head = j.kv_head;
    slot.work = load_work_tile<T>(p, static_cast<const int32_t*>(p.plan), j.work, group);
  }
  return slot;
}

// Producer thread 0 hands job number `seq` of the CTA to the consumers.
template <typename T>
__device__ __forceinline__ void publish_job(typename T::SharedStorage& smem, int seq, const JobSlot& slot) {
  using Barrier = cutlass::arch::ClusterBarrier;
  Barrier::wait(&smem.job_empty[seq % 2], ((seq / 2) & 1) ^ 1);  // a fresh barrier counts as released
  smem.jobs[seq % 2] = slot;
  Barrier::arrive(&smem.job_full[seq % 2]);
}

// The slot of the CTA's job `seq`, as a consumer thread takes it; it stays the consumers' until
// release_job.
template <typename T>
__device__ __forceinline__ const JobSlot& take_job(typename T::SharedStorage& smem, int seq) {
  using Barrier = cutlass::arch::ClusterBarrier;
  Barrier::wait(&smem.job_full[seq % 2], (seq / 2) & 1);
  return smem.jobs[seq % 2];
}
template <typename T>
__device__ __forceinline__ void release_job(typename T::SharedStorage& smem, int seq) {
  cutlass::arch::ClusterBarrier::arrive(&smem.job_empty[seq % 2]);
}

// Persistent: one CTA per SM slot, each running jobs (next_job) until none is left. Within a CTA
// the producer runs ahead into the next job (its Q once the last Q K^T of this one is done, its
// K/V tiles as stages free up) while the consumers finish and store this one; each job comes to
// both roles through shared memory, read from the plan once.
template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1) prefill_kernel(const __grid_constant__ KernelArgs<T> args) {
  using Barrier = cutlass::arch::ClusterBarrier;
  const auto& p = args.p;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (int(blockIdx.x) >= num_jobs_of(p)) return;  // more CTAs than jobs (a static CUDA-graph grid)

  if (threadIdx.x == 0) {
    if (args.box_rows > 0) {
      cute::prefetch_tma_descriptor(&args.k_pages);
      cute::prefetch_tma_descriptor(&args.v_pages);
    }
    if (args.q_boxed) cute::prefetch_tma_descriptor(&args.q_rows);
    if constexpr (T::kVtAhead) cute::prefetch_tma_descriptor(&args.vt_blocks);
#pragma unroll
    for (int b = 0; b < T::kQBuffers; ++b) {
      Barrier::init(&smem.q_full[b], args.q_boxed ? 1 : T::kProducerThreads);  // thread 0's, or every gathering thread's
      Barrier::init(&smem.q_empty[b], T::kConsumerThreads);
    }
#pragma unroll
    for (int s = 0; s < T::kStages; ++s) {
      Barrier::init(&smem.k_full[s], 1);  // a TMA thread's or thread 0's for a gathered tile
      Barrier::init(&smem.v_full[s], 1);
      Barrier::init(&smem.k_empty[s], T::kConsumerThreads);
      Barrier::init(&smem.v_empty[s], T::kConsumerThreads);
    }
#pragma unroll
    for (int b = 0; b < T::kVStaging; ++b) Barrier::init(&smem.v_rows_full[b], 1);  // thread 0's
    if constexpr (T::kDecodeItems) {
#pragma unroll
      for (int b = 0; b < T::kVStaging; ++b) Barrier::init(&smem.v_rows_empty[b], 1);  // the transposer's first thread's
    }
    for (int i = 0; i < 2; ++i) {
      Barrier::init(&smem.item_done[i], 1);  // thread 0's
      Barrier::init(&smem.job_full[i], 1);
      Barrier::init(&smem.job_empty[i], T::kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const common::FastDivmod group(p.group_size);
  PipelineCount<T::kStages> count;
  if (threadIdx.x < T::kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0) smem.producer_jobs[0] = job_slot<T>(p, group, blockIdx.x);
    cutlass::arch::NamedBarrier::sync(T::kProducerThreads, kBarrierProducer);
    for (int seq = 0;; ++seq) {
      const JobSlot& job = smem.producer_jobs[seq % 2];
      if (threadIdx.x == 0) publish_job<T>(smem, seq, job);
      if (job.job >= num_jobs_of(p)) break;
      // The next job, taken and read from the plan by thread 0 (an atomic and a chain of
      // dependent loads; T::kClaimEarly says when): after the job's last load they delay the next
      // Q, for which the consumers wait at every job's start.
      produce<T>(smem, args, job, group, count, [&] {
        if (threadIdx.x == 0) {
          smem.producer_jobs[(seq + 1) % 2] =
              job_slot<T>(p, group, next_job(static_cast<int32_t*>(p.plan), num_jobs_of(p)));
        }
      });
      cutlass::arch::NamedBarrier::sync(T::kProducerThreads, kBarrierProducer);
    }
    common::cp_async_wait<0>();  // nothing may still be landing when the CTA exits
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    for (int seq = 0;; ++seq) {
      const JobSlot& job = take_job<T>(smem, seq);
      if (job.job >= num_jobs_of(p)) break;
      consume<T>(smem, args, job, group, count);
      release_job<T>(smem, seq);
    }
  }
}

template <typename T>
cudaError_t prefill_set_smem() {
  // Set per launch: the opt-in is per device, and processes may drive several GPUs.
  return cudaFuncSetAttribute(prefill_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
}

// K and V as (dim, row in page, head, page) tensors, boxed a page at a time (ragged: one page of
// every row, boxed kBlockN rows at a time). Pages shorter than a tile must be a multiple of the
// 8-row swizzle atom that divides it; other page sizes leave box_rows 0 and every tile gathered.
template <typename T>
cudaError_t encode_kv_maps(KernelArgs<T>& args) {
  const auto& p = args.p;
  const int64_t page_size = T::kPagedKV ? p.page_size : p.num_pages;
  const bool boxable = page_size >= T::kBlockN || (page_size % 8 == 0 && T::kBlockN % page_size == 0);
  args.box_rows = p.num_pages > 0 && (boxable || !T::kPagedKV) ? int(std::min<int64_t>(page_size, T::kBlockN)) : 0;
  if (args.box_rows == 0) return cudaSuccess;
  args.boxes = T::kPagedKV ? T::kBlockN / args.box_rows : 1;
  const int64_t pages = T::kPagedKV ? p.num_pages : 1;
  const int64_t k_page_stride = T::kPagedKV ? p.kv_stride_page : p.kv_stride_token * page_size;
  const int64_t v_page_stride = T::kPagedKV ? p.v_stride_page : p.v_stride_token * page_size;
  constexpr int kBytes = T::kElementBytes;
  const cudaError_t err =
      host::encode_pages_map<kBytes>(&args.k_pages, p.k, T::kHeadDimQK, page_size, p.num_kv_heads, pages,
                                     p.kv_stride_token, p.kv_stride_head, k_page_stride, args.box_rows);
  if (err != cudaSuccess) return err;
  return host::encode_pages_map<kBytes>(&args.v_pages, p.v, T::kHeadDimVO, page_size, p.num_kv_heads, pages,
                                        p.v_stride_token, p.v_stride_head, v_page_stride, args.box_rows);
}

// Q boxed by TMA when a tile's packed rows are whole tokens of one kv head's `group` heads (the
// group divides the tile) and the strides and base suit TMA; else q_boxed stays 0 (gathered).
template <typename T>
cudaError_t encode_q_map(KernelArgs<T>& args) {
  const auto& p = args.p;
  constexpr int kBytes = T::kElementBytes;
  const bool aligned = reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && p.q_stride_h * kBytes % 16 == 0 &&
                       p.q_stride_n * kBytes % 16 == 0 && p.q_stride_h > 0 && p.q_stride_n > 0;
  if (!aligned || T::kBlockM % p.group_size != 0 || p.q_tokens < 1) return cudaSuccess;
  const cudaError_t err = host::encode_q_map<kBytes>(&args.q_rows, p.q, T::kHeadDimQK, p.num_qo_heads, p.q_tokens,
                                                     p.q_stride_h, p.q_stride_n, p.group_size,
                                                     T::kBlockM / p.group_size);
  args.q_boxed = err == cudaSuccess;
  return cudaSuccess;  // a layout the driver refuses is gathered
}

// V transposed ahead: the workspace's blocks, [kv head][block][dim][kBlockN keys].
template <typename T>
cudaError_t encode_vt_map(KernelArgs<T>& args) {
  static_assert(T::kBlockN * T::kElementBytes == host::kTmaBoxBytes, "fa3 V transposed ahead: a block's keys fill one line");
  return host::encode_blocks_map(&args.vt_blocks, args.p.v_transposed, T::kHeadDimVO, T::kBlockN, args.p.vt_blocks,
                                 args.p.num_kv_heads);
}

template <typename T>
cudaError_t prefill_occupancy(int* ctas_per_sm) {
  const cudaError_t err = prefill_set_smem<T>();
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, prefill_kernel<T>, T::kThreads, T::kSmemBytes);
}

// One persistent CTA per SM slot (max_ctas, which plan() sized with prefill_occupancy), never more
// than the jobs the plan can hold (so a CUDA graph's grid stays fixed: both are static there).
template <typename T>
cudaError_t launch_prefill(const typename T::Params& p, cudaStream_t stream) {
  if constexpr (T::kHasVtAhead && !T::kVtAhead) {
    // Ragged K shorter than a tile is gathered, which the kernel with V transposed ahead never
    // expects (GatheredOperands): such a launch transposes V itself.
    if (p.v_transposed != nullptr && (T::kPagedKV || p.num_pages >= T::kBlockN)) {
      return launch_prefill<typename T::WithVtAhead>(p, stream);
    }
  }
  if constexpr (T::kHasDecodeItems && !T::kDecodeItems && !T::kVtAhead) {
    // One query token per request: a decode instantiation (items of <= 64 rows leave consumer
    // warpgroup 1 free to transpose V; it checks each item's rows itself). Items of at most 8
    // rows, which the plan vouches for (one_token_requests), run with the keys along M.
    if constexpr (T::kHasKeysAlongM) {
      if (p.one_token_requests && p.group_size <= 8) {
        return launch_prefill<typename T::template WithDecodeRows<8>>(p, stream);
      }
    }
    // The plan's q tiles are this kernel's: the decode instantiation (two consumer warpgroups) takes
    // them where they are its own too, or where a request's rows fit in its one tile.
    using Decode = typename T::template WithDecodeRows<64>;
    const bool decode_tiles = T::kBlockM == Decode::kBlockM || p.group_size <= Decode::kBlockM;
    if (p.q_tokens == p.batch_size && decode_tiles) return launch_prefill<Decode>(p, stream);
  }
  cudaError_t err = prefill_set_smem<T>();
  if (err != cudaSuccess) return err;
  KernelArgs<T> args{};
  args.p = p;
  err = encode_kv_maps<T>(args);
  if (err == cudaSuccess) err = encode_q_map<T>(args);
  if (err != cudaSuccess) return err;
  if constexpr (T::kVtAhead) {
    err = encode_vt_map<T>(args);
    if (err != cudaSuccess) return err;
  }
  const int64_t jobs = int64_t(p.work_capacity) * p.num_kv_heads;
  const int grid = int(std::min<int64_t>(jobs, p.max_ctas));
  if (grid == 0) return cudaSuccess;
  prefill_kernel<T><<<grid, T::kThreads, T::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// V transposed ahead (kVtAhead)
//
// Every q tile of a prefill request reads all of the request's V, and an fp8 producer transposed
// each V tile again for each of them: without the transposes the ragged kernel ran 7-8% faster at
// hd 128 and 12-13% at hd 256, the paged one 16-20% (same-run ablation, e4m3, 4 x 4096). For plans
// whose requests have several q tiles the wrapper has it done once, before the kernel, into its
// workspace: transposed block b of kv head h holds request r's keys kBlockN (b - vt_block[r]) on
// (vt_block: each request's first block, in the plan image) as the PV wgmma reads them (dims x
// keys in slot order, p_key_of_slot), zeros past the request's end.

template <typename T>
struct TransposeVStorage {
  alignas(1024) typename T::Element vt[T::kHeadDimVO * T::kBlockN];
  PageRow page_rows[T::kPagedKV ? T::kBlockN : 0];
};

// Block blockIdx.x for kv head blockIdx.y: gathered and transposed into shared memory as the
// producer does it for a gathered tile, then stored by one box of the map the prefill kernel
// loads it with (which lays the swizzled tile down plainly, and gives it back alike).
template <typename T>
__global__ void __launch_bounds__(T::kProducerThreads) transpose_v_kernel(const __grid_constant__ KernelArgs<T> args) {
  const auto& p = args.p;
  const auto* plan = static_cast<const int32_t*>(p.plan);
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<TransposeVStorage<T>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int block = blockIdx.x, kv_head = blockIdx.y, tid = threadIdx.x;
  // The block's request: the last whose first block is at or before it (empty requests have none).
  const int32_t* first_block = plan + p.off_vt_block;
  int request = 0;
  for (int hi = p.batch_size - 1; request < hi;) {
    const int mid = (request + hi + 1) / 2;
    if (first_block[mid] <= block) request = mid; else hi = mid - 1;
  }
  const int first = (block - first_block[request]) * T::kBlockN, end = plan[p.off_kv_len + request];
  const int kv_token_base = T::kPagedKV ? 0 : plan[p.off_kv_indptr + request];
  if constexpr (T::kPagedKV) {
    bool bad_page = false;  // the prefill kernel reads the same page ids for K, and reports them
    const auto* page_ids = static_cast<const int32_t*>(p.indices) + plan[p.off_kv_indptr + request];
    fill_page_table<T>(smem.page_rows, p, page_ids, common::FastDivmod(p.page_size), first, end, tid, bad_page);
    __syncthreads();
  }
  load_v_tile_transposed<T>(reinterpret_cast<uint8_t*>(smem.vt),
                            static_cast<const typename T::DTypeKV*>(p.v) + kv_head * p.v_stride_head, tid,
                            gathered_rows<T>(smem.page_rows, first, end, kv_token_base, p.v_stride_page, p.v_stride_token), 0);
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  if (tid == 0) {
    cute::SM90_TMA_STORE_4D::copy(&args.vt_blocks, smem.vt, 0, 0, block, kv_head);
    cute::tma_store_arrive();
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // written, not only read out of shared memory
  }
}

// The transpose ahead of a V-transposed prefill launch (the module's prefill_run launches it before
// launch_prefill when p.v_transposed is set); kernels without that instantiation refuse.
template <typename T>
cudaError_t launch_transpose_v(const typename T::Params& p, cudaStream_t stream) {
  if constexpr (!T::kHasVtAhead) {
    return cudaErrorNotSupported;
  } else {
    if (p.vt_blocks == 0) return cudaSuccess;
    using Vt = typename T::WithVtAhead;
    KernelArgs<Vt> args{};
    args.p = p;
    const cudaError_t err = encode_vt_map<Vt>(args);
    if (err != cudaSuccess) return err;
    constexpr int kSmemBytes = int(sizeof(TransposeVStorage<Vt>)) + 1024;
    static_assert(kSmemBytes <= 48 * 1024, "fa3 V transpose: one block fits the default shared memory");
    transpose_v_kernel<Vt><<<dim3(p.vt_blocks, p.num_kv_heads), Vt::kProducerThreads, kSmemBytes, stream>>>(args);
    return cudaGetLastError();
  }
}

}  // namespace attnforge::fa3
