// Role: the FA2 batch decode kernel over a paged KV cache (one query token per request), composed of
//   the CUDA-core tile (decode_simt.cuh) or the tensor-core tile (decode_mma.cuh, kMmaTile); with its
//   launch and occupancy query.
//
// Contract:
//   grid  = work_capacity * num_head_tiles * num_kv_heads CTAs in x, the kv head fastest;
//   block = (kBdx, kBdy, kBdz), 128 threads.
//   A CTA takes one planned work item (request, kv token range [begin, end)) for one kv head and
//   up to kHeadsPerCta of the query heads that share it, so K/V are read once per group; a work
//   index at or past the plan's num_work (padding of a static CUDA-graph grid) exits at once.
//   Its k_scale folds into score_scale on the host and v_scale multiplies o after the kernel.
//   K/V tiles stream through a kStages-deep cp.async ring; a padded 16-bit row on the tensor-core
//   tile copies the whole 128-byte lines around its head slice where the pages allow it
//   (line_window_lead: NHD, line-aligned strides). A row's source offset is looked up once
//   per tile, by the row's owner thread, two tiles ahead of its copies (a tile in a register for the
//   page-id load, a tile in shared memory for the copying threads), so the gather never waits on
//   the page table and the kBdx copies of a row do not each repeat the lookup.
//   After the kv loop the token lanes' states merge through shared memory into token lane 0.
//   Output: softmax-normalized o and base-2 lse (log2 of the denominator plus the scaled max),
//   either straight into o/lse or, for a split request, into the fp32 partial slot the plan gave.
//   A row written to o joins its attention sink (p.sinks, common::with_sink); a partial row does
//   not (the merge joins it). The last CTA of a split (request, kv head, head tile) to store its
//   partials merges them all into o/lse (merge_if_last): one launch per run, no merge kernel.
//   An empty range writes o = 0, lse = -inf (before the sink). A page id outside [0, num_pages)
//   never reaches memory: the CTA reads page 0 instead, writes NaN, and raises the plan's error word.
//   Position encodings (decode_simt.cuh) run on the CUDA-core tile; the query's position comes from
//   the plan's kv_len[request].
//   PDL (common/pdl.cuh): every thread waits before the first plan read; the kv loop's end lets the
//   next kernel launch.
//
// Must not: decide anything about scheduling (the plan did) or know about dtypes beyond common/vec.cuh.
#pragma once

#include <cstdint>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/merge.cuh"
#include "../common/pdl.cuh"
#include "../common/plan_image.cuh"
#include "../common/vec.cuh"
#include "../host/launch.h"

#include "decode_traits.cuh"
#include "decode_simt.cuh"
#include "decode_mma.cuh"
#include "pos_encoding.cuh"

namespace attnforge::fa2 {

// The fused merge of a split request (common::merge_partial_row, as the standalone merge kernel):
// the CTAs of one (request, kv head, head tile) count their arrivals on the plan's merge counter
// and the last one merges that unit's partials into o, so a split run is one launch. The counter
// goes back to 0 for the next run or graph replay. Called by every thread of a CTA that wrote its
// partials.
template <typename T>
__device__ __forceinline__ void merge_if_last(const typename T::Params& p, int32_t* plan, int request, int kv_head,
                                              int head_tile, int tid) {
  const int first = plan[p.off_partial_indptr + request];
  const int last = plan[p.off_partial_indptr + request + 1];
  int32_t* counter = plan + p.off_merge_counters + (request * p.num_kv_heads + kv_head) * p.num_head_tiles + head_tile;
  __threadfence();  // this thread's partial stores are visible device-wide before the arrival
  __syncthreads();
  bool merges = false;
  if (tid == 0) {
    merges = atomicAdd(counter, 1) == last - first - 1;
    if (merges) atomicExch(counter, 0);  // every unit's CTA has arrived: nobody else touches it this run
  }
  if (!__syncthreads_or(merges)) return;
  __threadfence();  // order the other CTAs' partials (seen through the counter) before the reads

  const common::MergeArgs args{plan, p.off_partial_indptr, p.batch_size, p.num_qo_heads,
                               static_cast<const float*>(p.tmp_v), static_cast<const float*>(p.tmp_s), p.o,
                               p.o_stride_n, p.o_stride_h, static_cast<float*>(p.lse),
                               static_cast<const float*>(p.sinks)};
  constexpr int kColThreads = T::kHeadDim / common::kMergeCols;  // merge_partial_row's threads per head
  const int first_slot = head_tile * T::kHeadsPerCta;
  for (int i = tid; i < T::kHeadsPerCta * kColThreads; i += T::kThreads) {
    const int h = i / kColThreads;
    if (first_slot + h >= p.group_size) break;
    common::merge_partial_row<typename T::DTypeO, T::kHeadDim>(args, request, kv_head * p.group_size + first_slot + h,
                                                               first, last, (i % kColThreads) * common::kMergeCols);
  }
}

// The cells by which a padded 16-bit MMA row's ring window starts before its kv head's slice, so
// that the ring row holds the whole 128-byte lines the slice touches: in NHD a 160-byte slice (hd
// 80) shares both its lines with a neighbour head's CTA, and lines requested in parts by two SMs
// hold DRAM well under its peak (docs/design.md, FA2 decode). -1 where
// the window does not apply: heads not side by side in a token row (HND), a base, token or page
// stride that is not whole lines, a slice too far into its line, or a window past the token row.
template <typename T>
__device__ __forceinline__ int line_window_lead(const typename T::Params& p, int kv_head) {
  if constexpr (!T::kLineWindow) {
    return -1;
  } else {
    constexpr int kLine = 128, kSize = sizeof(typename T::DTypeKV);
    const int64_t slice = int64_t(kv_head) * T::kHeadDim * kSize;  // bytes after the row's head 0
    const int offset = static_cast<int>(slice % kLine);
    const bool whole_lines = p.kv_stride_head == T::kHeadDim && (p.kv_stride_token * kSize) % kLine == 0 &&
                             (p.kv_stride_page * kSize) % kLine == 0 &&
                             reinterpret_cast<uintptr_t>(p.k) % kLine == 0 && reinterpret_cast<uintptr_t>(p.v) % kLine == 0;
    const bool fits = offset / 16 + T::kCells <= T::kRowCells &&
                      slice - offset + T::kRowCells * 16 <= int64_t(p.num_kv_heads) * T::kHeadDim * kSize;
    return whole_lines && fits ? offset / 16 : -1;
  }
}

template <typename T>
__global__ void __launch_bounds__(T::kThreads, T::kMinCtasPerSm) decode_kernel(const __grid_constant__ typename T::Params p) {
  using DTypeKV = typename T::DTypeKV;
  constexpr int H = T::kHeadsPerThread;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  int32_t* plan = static_cast<int32_t*>(p.plan);

  common::wait_for_prior_grids();  // PDL: the plan, q and K/V may come from the kernel before
  // kv head fastest: a request's kv heads start together over the same tokens, so the pages' token
  // rows (all heads side by side) are read at once; apart, a head slice that does not fill its 64-byte
  // DRAM bursts (16-bit hd 80, 112) fetches its neighbours' bytes again.
  const int kv_head = blockIdx.x % p.num_kv_heads;
  const int work = blockIdx.x / p.num_kv_heads / p.num_head_tiles;
  if (work >= plan[common::kPlanNumWork]) return;  // padding of a static (CUDA-graph) grid
  const int head_tile = blockIdx.x / p.num_kv_heads % p.num_head_tiles;
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

  // Each thread copies the same kChunksPerThread chunks of every tile: cell tid % kRowCells of rows
  // tid / kRowCells + c * kRowsPerPass. Thread r < kTileTokens owns row r's offset. Branch-free: a row
  // past the range keeps page 0's address and copies zeros (its validity is recomputed at issue
  // instead of being carried in the offset). Offsets are in bytes so that issuing a copy is one
  // 64-bit add per tensor.
  // A padded row reads its real cells, zero-filling the rest without a read, or the whole lines
  // around them (line_window_lead), the slice then starting lead_cells into the ring row.
  constexpr int kRowsPerPass = T::kThreads / T::kRowCells;
  const int window = line_window_lead<T>(p, kv_head);
  const int lead_cells = window < 0 ? 0 : window;
  const int read_cells = window < 0 ? T::kCells : T::kRowCells;
  const int copy_row = tid / T::kRowCells;
  const int copy_cell = tid % T::kRowCells;
  const int copy_col = (copy_cell - lead_cells) * T::kVec;
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
      const bool valid = first_token + c * kRowsPerPass < end && (!T::kPaddedRow || copy_cell < read_cells);
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
    common::allow_dependent_grids();  // PDL: the next step may start its launch (it waits for this grid to complete)
  };
  // After the kv loop every token lane's state is in smem.lanes, except that the CUDA-core tile's
  // lane 0 keeps its own in `st`; token lane 0's threads then merge the others into st.
  SoftmaxState<T::kLaneDim> st[H];
  constexpr int kFirstMergedLane = T::kMmaTile ? 0 : 1;
  constexpr int kNumLanes = T::kMmaTile ? T::kMmaRowBlocks : T::kBdz;
  if constexpr (T::kMmaTile) {
    const int warp = tid / 32, lane = tid % 32;
    MmaQuery<T::kMmaWarpChunks> q;
    load_query_mma<T>(p, request, kv_head, cta_slot, warp, lane, q);
    MmaState<T::kMmaWarpChunks> lane_state;
    run_tiles([&](int stage, int valid_rows) {
      decode_tile_mma<T>(reinterpret_cast<const uint8_t*>(smem.ring.k[stage]),
                         reinterpret_cast<const uint8_t*>(smem.ring.v[stage]), q, valid_rows, p.post_scale,
                         smem.mma_probs[warp], smem.mma_scores, lead_cells / 2, warp, lane, lane_state);
    });
    __syncthreads();  // every warp is done reading the ring the lane states overwrite
    share_mma_state<T>(lane_state, smem.lanes, warp, lane);
  } else {
    const ScoreOwner owner = score_owner<T>(tx);
    DecodePositions at{};
    if constexpr (T::kPosEncoding != kPosNone) {
      at = {begin, plan[p.off_kv_len + request] - 1, 0.f, p.rope_rcp_scale, p.rope_rcp_theta};
      if constexpr (T::kPosEncoding == kPosAlibi) {
        const int qo_head = kv_head * p.group_size + min(first_slot + owner.head, p.group_size - 1);
        // Bias in score units: base 2, and divided by the cap when a soft cap follows.
        at.alibi = alibi_slope(qo_head, p.num_qo_heads) * (T::kSoftCap ? common::kLog2e / p.post_scale : common::kLog2e);
      }
    }
    typename T::Query q;  // slot h: head h ^ owner.head (see ScoreOwner)
    if constexpr (T::kPackedMath) {
      float qf[H][T::kLaneDim];
      load_query<T>(p, request, kv_head, first_slot, owner, at, tx, qf);
      pack_query<T>(qf, p.score_scale, q);
    } else {
      load_query<T>(p, request, kv_head, first_slot, owner, at, tx, q);
#pragma unroll
      for (int h = 0; h < H; ++h) {
#pragma unroll
        for (int e = 0; e < T::kLaneDim; ++e) q[h][e] *= p.score_scale;
      }
    }
    float o[H][T::kLaneDim] = {};
    OwnedHead own;
    run_tiles([&](int stage, int valid_rows) {
      decode_tile<T>(smem.ring.k[stage], smem.ring.v[stage], q, owner, at, valid_rows, p.post_scale, smem.rows[tz][ty],
                     own, o);
      at.tile_first += T::kTileTokens;
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
      for (int e = 0; e < T::kLaneDim; ++e) st[h].o[e] = o[h][e];
    }
    if constexpr (T::kBdz > 1) {
      __syncthreads();  // every lane is done reading the ring the lane states overwrite
#pragma unroll
      for (int h = 0; h < H; ++h) {
#pragma unroll
        for (int e = 0; e < T::kLaneDim; ++e) smem.lanes.o[tz][ty * H + h][tx * T::kLaneDim + e] = st[h].o[e];
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
                      &smem.lanes.o[lane][ty * H + h][tx * T::kLaneDim]);
        }
      }
    }
  }
  bad_page = __syncthreads_or(bad_page);
  if (bad_page && tid == 0) atomicOr(&plan[common::kPlanError], common::kPlanErrorBadPage);

  // Token lane 0 stores; the other lanes and padding lanes only join the fused merge's barriers.
  if (tz == 0 && tx < T::kCells) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      if (first_slot + h >= p.group_size) break;
      const int qo_head = kv_head * p.group_size + first_slot + h;
      float inv_d = bad_page ? NAN : (st[h].d > 0.f ? 1.f / st[h].d : 0.f);
      float lse = bad_page ? NAN : (st[h].d > 0.f ? st[h].m + log2f(st[h].d) : common::kNegInf);
      if (slot < 0 && p.sinks != nullptr) {
        const common::SinkJoin joined = common::with_sink(lse, static_cast<const float*>(p.sinks)[qo_head]);
        inv_d *= joined.scale;
        lse = joined.lse;
      }
      float out[T::kCellsPerLane][T::kVec];
#pragma unroll
      for (int c = 0; c < T::kCellsPerLane; ++c) {
#pragma unroll
        for (int e = 0; e < T::kVec; ++e) out[c][e] = st[h].o[c * T::kVec + e] * inv_d;
      }
      if (slot < 0) {
        auto* o_row = static_cast<typename T::DTypeO*>(p.o) + request * p.o_stride_n + qo_head * p.o_stride_h;
#pragma unroll
        for (int c = 0; c < T::kCellsPerLane; ++c) common::store_float(o_row + T::lane_col(tx, c), out[c]);
        if (p.lse != nullptr && tx == 0) static_cast<float*>(p.lse)[int64_t(request) * p.num_qo_heads + qo_head] = lse;
      } else {
        const int64_t row = int64_t(slot) * p.num_qo_heads + qo_head;
        float* partial = static_cast<float*>(p.tmp_v) + row * T::kHeadDim;
#pragma unroll
        for (int c = 0; c < T::kCellsPerLane; ++c) {
#pragma unroll
          for (int e = 0; e < T::kVec; e += 4) {
            *reinterpret_cast<float4*>(partial + T::lane_col(tx, c) + e) =
                make_float4(out[c][e], out[c][e + 1], out[c][e + 2], out[c][e + 3]);
          }
        }
        if (tx == 0) static_cast<float*>(p.tmp_s)[row] = lse;
      }
    }
  }
  if (slot >= 0) merge_if_last<T>(p, plan, request, kv_head, head_tile, tid);
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
  const int64_t ctas = int64_t(p.work_capacity) * p.num_head_tiles * p.num_kv_heads;
  if (ctas > INT32_MAX) return cudaErrorInvalidConfiguration;  // gridDim.x's limit is 2^31 - 1
  const dim3 grid(static_cast<unsigned>(ctas));
  const dim3 block(T::kBdx, T::kBdy, T::kBdz);
  return host::launch_kernel(decode_kernel<T>, grid, block, kSmem, stream, p.enable_pdl != 0, p);
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
