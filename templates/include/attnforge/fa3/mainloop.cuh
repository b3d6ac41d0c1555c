// Role: a consumer warpgroup's kv loop, in its two forms: overlapped (S_n's wgmma beside
//   P_{n-1} V_{n-1}'s, two warpgroups in pingpong) and in order (three warpgroups, each tile's S,
//   weights and P.V one after another); plus the loop a warpgroup without rows follows to keep the
//   barrier counts, and the job's end.
// Contract: every consumer thread arrives once per tile on k_empty / v_empty and once per job on
//   q_empty, whether it computes or only follows; a gathered operand is fenced (generic -> async
//   proxy) before a wgmma reads it.
// Must not: know the operand layouts: the caller passes the wgmma issue and softmax steps as lambdas.
#pragma once

#include "scheduler.cuh"
#include "transpose_v.cuh"
#include "softmax.cuh"

namespace attnforge::fa3 {

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
// The fence (MEMBAR and FENCE.VIEW.ASYNC in the SASS) before each tile's two wgmma batches costs
// the in-order fp8 loop 1-3%. 16-bit kernels fence every tile: a per-tile test makes ptxas
// serialize their wgmmas (C7512).
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
  // Always inlined: as a plain lambda ptxas schedules the peeled fp8 loop worse.
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
  // registers keep Q's descriptors out of local memory (e4m3 +2.3..+4.3%). 16-bit kernels keep
  // one loop: peeled, ptxas serializes their wgmmas (C7512).
  if constexpr (T::kStaggeredStarts) {
    run_tile(0, std::true_type{});
    for (int n = 1; n < num_tiles; ++n) run_tile(n, std::false_type{});
  } else {
    for (int n = 0; n < num_tiles; ++n) run_tile(n, std::false_type{});
  }
}

}  // namespace attnforge::fa3
