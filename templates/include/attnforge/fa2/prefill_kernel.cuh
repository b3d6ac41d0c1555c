// Role: the FA2 batch prefill kernel on tensor cores (mma.sync m16n8k16, fp32 accumulation), paged
//   or ragged KV, composed from the prefill role headers; with its launch and occupancy query.
//
// Contract:
//   grid = (work_capacity, num_kv_heads, kVOSlices), or (work_capacity * num_kv_heads, 1, kVOSlices)
//   with the kv head fastest (kKvHeadFastest: the 16-row tile); block = 128 threads (4 warps). A CTA takes one
//   planned work item (request, q tile, kv token range [begin, end)) for one kv head and one slice of
//   o's columns (all of them below head dim 512); a work index at or past the plan's num_work
//   (padding of a static CUDA-graph grid) exits at once. Its kCtaTileQ rows are
//   packed (token, head-in-group) rows, so K/V are read once per group. Warps split the rows
//   (kCtaTileQ 64/128: 16/32 rows each) or, at kCtaTileQ 16, the columns of every KV tile (their
//   (m, d, o) states merge through shared memory at the end).
//   Shared memory holds the Q tile, one K tile and one V tile; K_{i+1} loads during softmax and P.V
//   of tile i, V_{i+1} during Q.K of tile i+1 (FlashInfer's staggered loads), and two CTAs per SM
//   hide the rest.
//   An fp8 KV cache runs fp16 MMAs (prefill_mma.cuh); its k_scale / v_scale are the caller's (folded
//   into sm_scale_log2, applied to o after the kernel: RoPE is linear, so a scalar k_scale commutes
//   with rotating the unscaled fp8 K, which is what the kernel rotates).
//   The kernel narrows [begin, end) to the keys its rows can see (causal, window), skips nothing
//   else, and masks only tiles that straddle a boundary.
//   Output: o (+ lse, base 2) or, when work_partial >= 0, fp32 partial rows (prefill_epilogue.cuh).
//   A page id outside [0, num_pages) is never read (page 0 is), the CTA's rows come out NaN and the
//   plan's error word gets kPlanErrorBadPage.
//   PDL (common/pdl.cuh): every thread waits before the first plan read; the kv loop's end lets the
//   next kernel launch.
//
// Must not: decide scheduling (the plan did) or pick the variant (the dispatcher reads cta_tile_q).
#pragma once

#include <cstdint>

#include "../common/async_copy.cuh"
#include "../common/math.cuh"
#include "../common/pdl.cuh"
#include "../common/plan_image.cuh"
#include "../host/launch.h"

#include "prefill_traits.cuh"
#include "prefill_state.cuh"
#include "prefill_loads.cuh"
#include "prefill_mma.cuh"
#include "prefill_mask.cuh"
#include "prefill_softmax.cuh"
#include "prefill_epilogue.cuh"

namespace attnforge::fa2 {

template <typename T>
__global__ void __launch_bounds__(T::kThreads, T::kMinCtasPerSm) prefill_kernel(const __grid_constant__ typename T::Params p) {
  using DTypeQ = typename T::DTypeQ;
  using DTypeKV = typename T::DTypeKV;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  int32_t* plan = static_cast<int32_t*>(p.plan);

  common::wait_for_prior_grids();  // PDL: the plan, q and K/V may come from the kernel before
  const int work = T::kKvHeadFastest ? blockIdx.x / p.num_kv_heads : blockIdx.x;
  if (work >= plan[common::kPlanNumWork]) return;  // padding of a static (CUDA-graph) grid
  const int kv_head = T::kKvHeadFastest ? blockIdx.x % p.num_kv_heads : blockIdx.y;
  const int vo_first = T::kVOSlices > 1 ? blockIdx.z * T::kSliceVO : 0;  // this CTA's first column of V and o
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
        // Bias in score units: base 2, and divided by the cap when a soft cap follows.
        const float unit = T::kSoftCap ? common::kLog2e / p.soft_cap_log2 : common::kLog2e;
        rc.alibi[mq][rr] = alibi_slope(qo_head, p.num_qo_heads) * unit;
      }
    }
  }

  load_q_tile<T>(reinterpret_cast<DTypeQ*>(smem.tiles.q), p, rows, group, kv_head);
  common::cp_async_commit();
  if constexpr (T::kFp8KV) {
    if (threadIdx.x == 0) smem.tiles.q_abs_max[0] = 0u;
  }

  const auto* k_head = static_cast<const DTypeKV*>(p.k) + kv_head * p.kv_stride_head;
  const auto* v_head = static_cast<const DTypeKV*>(p.v) + kv_head * p.v_stride_head + vo_first;
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
    score_scale *= prepare_q_for_fp8_kv<T>(smem.tiles) / T::kRotatedKScale;
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
      rope_k_tile<T>(smem.tiles, first, p.rope_rcp_scale, p.rope_rcp_theta);
      __syncthreads();
    }
    const typename T::DTypeKScores* k_scores;
    if constexpr (T::kRotatedK16) {
      k_scores = smem.tiles.k16;
    } else {
      k_scores = smem.tiles.k;
    }
    float s[T::kMmaQ][T::kMmaKV][8];
    compute_scores<T>(smem.tiles.q, k_scores, warp_q, warp_kv, s);
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
    float alpha[T::kMmaQ][2];
    softmax_update<T>(s, T::kRawScores ? score_scale : 1.f, st, alpha);
    accumulate_pv<T>(smem.tiles.v, warp_kv, s, alpha, st);
  }
  common::cp_async_wait<0>();
  common::allow_dependent_grids();  // PDL: the next kernel (the merge, the next step) may start its launch

  // Without T::kRowSumMma each lane summed its own columns: complete each row's denominator over the
  // quad that shares it.
  if constexpr (!T::kRowSumMma) {
#pragma unroll
    for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        st.d[mq][rr] += __shfl_xor_sync(0xffffffffu, st.d[mq][rr], 1);
        st.d[mq][rr] += __shfl_xor_sync(0xffffffffu, st.d[mq][rr], 2);
      }
    }
  }
  bad_page = __syncthreads_or(bad_page);  // also: every warp is done with the tiles
  if (bad_page && threadIdx.x == 0) atomicOr(&plan[common::kPlanError], common::kPlanErrorBadPage);
  if constexpr (T::kWarpsKV > 1) {
    merge_warp_states<T>(smem, warp_kv, st);
    if (warp_kv != 0) return;
  }
  store_rows<T>(p, rows, rc, kv_head, warp_q, slot, vo_first, bad_page, st);
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
  const int64_t ctas_x = int64_t(p.work_capacity) * (T::kKvHeadFastest ? p.num_kv_heads : 1);
  if (ctas_x > INT32_MAX) return cudaErrorInvalidConfiguration;  // gridDim.x's limit is 2^31 - 1
  const dim3 grid(static_cast<unsigned>(ctas_x), T::kKvHeadFastest ? 1 : p.num_kv_heads, T::kVOSlices);
  return host::launch_kernel(prefill_kernel<T>, grid, dim3(T::kThreads), sizeof(typename T::SharedStorage), stream,
                             p.enable_pdl != 0, p);
}

// Work items (CTAs of all kVOSlices slices) an SM runs at once, as the planner counts them: CTAs per
// SM over the slices, at least one where a CTA fits (hd 512 on sm80: one CTA per SM, two per item).
template <typename T>
cudaError_t prefill_occupancy(int* ctas_per_sm) {
  const cudaError_t err = prefill_set_smem<T>();
  if (err != cudaSuccess) return err;
  int ctas = 0;
  const cudaError_t occ = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, prefill_kernel<T>, T::kThreads,
                                                                        sizeof(typename T::SharedStorage));
  *ctas_per_sm = ctas > 0 ? max(ctas / T::kVOSlices, 1) : 0;
  return occ;
}

}  // namespace attnforge::fa2
