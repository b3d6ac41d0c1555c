// Role: the producer warpgroup: per job, Q into its buffer (TMA box or cp.async), then each K/V
//   tile into the next free stage (TMA boxes spread over the four warps, or a cp.async gather),
//   fp8 V rows staged and transposed, and the item's page-id verdict for the consumers.
// Contract: for each kBlockN-token tile the producer waits for the stage's `empty` mbarrier, fills
//   the stage, and the `full` mbarrier counts the bytes (TMA) or the copies (cp.async), so consumers
//   wait for the data itself. Q loads once the last Q K^T of the job that held the buffer is done
//   (q_empty), so the producer runs into the next job while the consumers finish this one.
// Must not: compute (no wgmma, no softmax) or store outputs.
#pragma once

#include "scheduler.cuh"
#include "transpose_v.cuh"

namespace attnforge::fa3 {

__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(common::smem_addr(bar)));
}

// Q tile: kBlockM packed rows, then q_full. Boxed: thread 0 loads one box per swizzle line's column
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
    for (int col = 0; col < T::kTileDimQK; col += T::kLineElementsQK) {  // past kHeadDimQK: zeros (OOB)
      cute::SM90_TMA_LOAD_3D::copy(&args.q_rows, q.full, evict_first,
                                   base + swizzled_offset<typename T::SmemLayoutQ, typename T::Element>(0, col), col,
                                   kv_head * p.group_size, w.qo_begin + w.first_token);
    }
    return;
  }
  for (int idx = tid; idx < T::kBlockM * T::kTileCellsQK; idx += T::kProducerThreads) {
    const int row = idx / T::kTileCellsQK, cell = idx % T::kTileCellsQK;
    const bool valid = row < w.rows && cell < T::kCellsQK;  // padding cells: zeros
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

// One K or V tile: kBlockN rows of kCells 16-byte cells, row offsets from `row_offset(row)` (-1:
// past the range, zero-filled so P.V never meets garbage), smem position from `smem_offset`.
// A thread keeps one cell and walks rows kRowsPerPass apart; when that is a whole number of
// 8-row swizzle atoms its smem position only moves by a constant, so it is computed once. A row
// of cells that does not divide the warpgroup (24 for 192 16-bit dims, 10-28 for narrow-line
// tiles) is copied cell by cell, each thread finding its cell's row. Cells from kRealCells on (a
// padded tile dim) are zero-filled without a read.
template <typename T, int kCells, int kRealCells, typename RowOffset, typename SmemOffset>
__device__ __forceinline__ void load_kv_tile(uint8_t* smem_base, const typename T::DTypeKV* head_base, int tid,
                                             RowOffset row_offset, SmemOffset smem_offset) {
  if constexpr (T::kProducerThreads % kCells != 0) {
    constexpr int kUnroll = T::kGatherUnroll;
#pragma unroll kUnroll
    for (int idx = tid; idx < T::kBlockN * kCells; idx += T::kProducerThreads) {
      const int row = idx / kCells, cell = idx % kCells;
      const int64_t off = row_offset(row);
      common::cp_async_16(smem_base + smem_offset(row, cell), head_base + max(off, int64_t(0)) + cell * T::kCellElements,
                          off >= 0 && cell < kRealCells);
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
      common::cp_async_16(smem_base + dst, head_base + max(off, int64_t(0)) + cell * T::kCellElements,
                          off >= 0 && (kRealCells == kCells || cell < kRealCells));
    }
  }
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

// Each producer lane with a box copies its every column block (kLine elements, one swizzle line) of
// one tile of `map` into `tile`, element (row, col) at smem_offset(row, col). Thread 0 arms `full`
// (which expects kArrivals) with the whole tile's bytes; other warps' copies may land first (the
// barrier's transaction count may run negative until then, and its phase cannot complete before
// thread 0's arrival).
template <typename T, int kDims, int kLine, uint32_t kArrivals, typename SmemOffset>
__device__ __forceinline__ void box_tile(const CUtensorMap& map, const TileBoxes& boxes, int kv_head,
                                         uint8_t* tile, uint64_t* full, uint32_t bytes, SmemOffset smem_offset) {
  // K/V that the request's other q tiles reread stay in L2; a request of one q tile (decode) reads
  // them once, and they leave room for what is reread, the page ids among it.
  const auto hint = static_cast<uint64_t>(boxes.kv_read_once ? cute::TMA::CacheHintSm90::EVICT_FIRST
                                                             : cute::TMA::CacheHintSm90::EVICT_LAST);
  if (threadIdx.x == 0) arrive_for_all<kArrivals>(full, bytes);
  if (!boxes.boxing) return;
#pragma unroll
  for (int col = 0; col < kDims; col += kLine) {
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
  box_tile<T, T::kTileDimQK, T::kLineElementsQK, kFullArrivals<T>>(args.k_pages, boxes, kv_head, reinterpret_cast<uint8_t*>(smem.k),
                             &smem.k_full[stage], T::kTileBytesK, [&](int row, int col) {
                               return swizzled_offset<typename T::SmemLayoutK, Element>(row, col, stage);
                             });
  if constexpr (!T::kFp8) {
    Barrier::wait(&smem.v_empty[stage], free_phase);
    box_tile<T, T::kTileDimVO, T::kLineElementsVO, kFullArrivals<T>>(args.v_pages, boxes, kv_head, reinterpret_cast<uint8_t*>(smem.v),
                               &smem.v_full[stage], T::kTileBytesV, [&](int row, int col) {
                                 return swizzled_offset<typename T::SmemLayoutVt, Element>(col, row, stage);
                               });
  }
}

// V transposed ahead: transposed block `block` of the kv head, K-major as the PV wgmma reads it, into
// the stage once it is free; one box of the real dims (a padded tile's last rows stay unwritten),
// producer thread 0's.
template <typename T>
__device__ __forceinline__ void box_vt_tile(typename T::SharedStorage& smem, const KernelArgs<T>& args, int block,
                                            int stage, uint32_t free_phase, int kv_head) {
  if (threadIdx.x != 0) return;
  const auto evict_last = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_LAST);  // every q tile rereads it
  cutlass::arch::ClusterBarrier::wait(&smem.v_empty[stage], free_phase);
  arrive_for_all<kFullArrivals<T>>(&smem.v_full[stage], T::kVtBoxBytes);
  cute::SM90_TMA_LOAD_4D::copy(&args.vt_blocks, &smem.v_full[stage], evict_last,
                               reinterpret_cast<uint8_t*>(smem.v) + stage * T::kTileBytesV, 0, 0, block, kv_head);
}

// Every producer warp, fp8: its boxes of a V tile's rows, as they lie in memory, into staging
// buffer `buffer`.
template <typename T>
__device__ __forceinline__ void box_v_rows(typename T::SharedStorage& smem, const KernelArgs<T>& args,
                                           const TileBoxes& boxes, int buffer, int kv_head) {
  box_tile<T, T::kStagingDimVO, T::kLineElementsVO, 1>(args.v_pages, boxes, kv_head, reinterpret_cast<uint8_t*>(smem.v_rows),
                             &smem.v_rows_full[buffer], T::kStagingTileBytes, [&](int row, int col) {
                               return swizzled_offset<typename T::SmemLayoutVRows, typename T::Element>(row, col, buffer);
                             });
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
        // behind them would come late (warpgroup 0 waiting on k_full); in prefill, K first costs
        // the paged tiles.
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
    load_kv_tile<T, T::kTileCellsQK, T::kCellsQK>(k_smem, k_head, tid, row_offset(p.kv_stride_page, p.kv_stride_token), [&](int row, int cell) {
      return swizzled_offset<typename T::SmemLayoutK, typename T::Element>(row, cell * T::kCellElements, stage);
    });
    cp_async_arrive_noinc(&smem.k_full[stage]);  // one of kFullArrivals
    if constexpr (T::kVtAhead) {
      box_vt(first, stage, free_phase);
      continue;
    }
    Barrier::wait(&smem.v_empty[stage], free_phase);
    if constexpr (T::kFp8) {
      load_v_tile_transposed<T>(v_smem, v_head, tid, row_offset(p.v_stride_page, p.v_stride_token), stage);
      arrive_stored<T>(&smem.v_full[stage], kBarrierProducer, tid);
    } else {
      load_kv_tile<T, T::kTileCellsVO, T::kCellsVO>(v_smem, v_head, tid, row_offset(p.v_stride_page, p.v_stride_token), [&](int row, int cell) {
        return swizzled_offset<typename T::SmemLayoutVt, typename T::Element>(cell * T::kCellElements, row, stage);
      });
      cp_async_arrive_noinc(&smem.v_full[stage]);
    }
  }
  if (!T::kClaimEarly || num_tiles <= T::kStages) claim_next();
  count.advance(num_tiles);
  report_item<T>(smem, plan, count.items++, bad_page, tid);
}

}  // namespace attnforge::fa3
