// Role: the consumer of fp8 decode items of at most 8 rows (T::kKeysAlongM): the keys along the
//   wgmma's M, the item's rows along N.
// Contract: warpgroup 0 computes the item; warpgroup 1 has no rows, follows the pipeline and
//   transposes V (consumer_transposes). Outputs as in epilogue.cuh.
// Must not: be instantiated for prefill kernels (static_asserts in traits.cuh).
#pragma once

#include "mainloop.cuh"
#include "epilogue.cuh"

namespace attnforge::fa3 {

// ---------------------------------------------------------------------------------------------
// Decode items of at most 8 rows: the keys along M (T::kKeysAlongM)
//
// A decode item's rows are its request's GQA group, 1 to 8 of a 64-row wgmma's, and warpgroup 0's
// chain per tile (two 64 x 128 x 128 wgmmas and the softmax) bounds the decode kernel. Swapped, a
// tile's 128 keys are the M of two 64-row wgmmas and the item's rows the N (8):
//   S^T = K Q^T    (A: the K tile, B: Q's first 8 rows; both K-major as they lie),
//   O^T += V^T P^T (A: the transposed V tile, B: P^T, which the softmax writes to shared memory
//                   in V^T's key order),
// an eighth of the tensor work and of the exp2s (e4m3 b64 x 4096: 157 -> 149 us, docs/tried.md has
// the rows-along-M numbers). A thread holds 2 rows x 4 keys of S^T and 2 rows x
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
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::_8, cute::Int<T::kTileDimQK>>>()));
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
// dims of a row lie 8 apart or more: single stores (at a job's end only). Dims from kHeadDimVO on
// are a padded tile's (O^T's padding rows): never stored.
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
      for (int c = 0; c < size<1>(o); ++c) {
        const int dim = get<0>(coord(r, c));
        if (T::kTileDimVO == T::kHeadDimVO || dim < T::kHeadDimVO) o_row[dim] = DTypeO(o(r, c) * out.inv_d);
      }
      if (writes_lse && p.lse != nullptr) *out.lse_at(p, w) = out.lse;
    } else {
      const int64_t prow = out.partial_row(p, w, item.num_chunks);
      float* partial = static_cast<float*>(p.tmp_v) + prow * T::kHeadDimVO;
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) {
        const int dim = get<0>(coord(r, c));
        if (T::kTileDimVO == T::kHeadDimVO || dim < T::kHeadDimVO) partial[dim] = o(r, c) * out.inv_d;
      }
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
  Tensor tSrQ = operands_kq.partition_fragment_B(local_tile(sQ, Shape<_8, Int<T::kTileDimQK>>{}, make_coord(0, 0)));
  Tensor tOrV = operands_vp.partition_fragment_A(make_tensor(make_smem_ptr(smem.v), typename T::SmemLayoutVt{}));
  Tensor tOrP = operands_vp.partition_fragment_B(make_tensor(make_smem_ptr(smem.p), typename Swapped::SmemLayoutP{}));
  Tensor tSrS = partition_fragment_C(mma_kq, Shape<Int<T::kBlockN>, _8>{});
  Tensor tOrO = partition_fragment_C(mma_vp, Shape<Int<T::kTileDimVO>, _8>{});
  Tensor s = make_tensor(tSrS.data(), colrow(tSrS.layout()));
  Tensor o = make_tensor(tOrO.data(), colrow(tOrO.layout()));
  Tensor cS = mma_kq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, _8>{}));
  Tensor s_coord = make_tensor(cS.data(), colrow(cS.layout()));  // (key, row)
  Tensor cO = mma_vp.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<T::kTileDimVO>, _8>{}));
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

}  // namespace attnforge::fa3
