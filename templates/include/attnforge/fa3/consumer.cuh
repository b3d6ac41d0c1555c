// Role: a consumer warpgroup's part of a job: its rows' wgmmas Q K^T (SS) and P.V (RS) over the
//   kv loop of mainloop.cuh, the softmax of softmax.cuh, and the store of epilogue.cuh; dispatch to
//   the keys-along-M form for small decode items.
// Contract: consumer warpgroup i owns rows [64 i, 64 i + 64) of the job's tile; a warpgroup whose
//   rows all lie past the item's runs no wgmma and only follows the pipeline.
// Must not: load K/V or Q (the producer does).
#pragma once

#include "consumer_keys_along_m.cuh"

namespace attnforge::fa3 {

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
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<T::kBlockM>, Int<T::kTileDimVO>>{});
  Tensor o = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
  Tensor s_coord = make_tensor(cS.data(), rowcol(cS.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kTileDimVO>>{}));
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

}  // namespace attnforge::fa3
