// Role: the persistent schedule: a CTA's jobs taken from the plan's counter, a job's work tile
//   read from the plan and handed producer -> consumers through shared-memory slots, where a CTA's
//   pipelines stand (PipelineCount), its Q buffers, and the consumer warpgroups' turn-taking
//   (pingpong, staggered starts) on named barriers.
// Contract: a CTA runs job blockIdx.x, then takes the next untaken one from the plan's job counter
//   until none is left (jobs are numbered kv-head-major in the plan's order, longest first); the
//   counter is 0 again after each launch, so a CUDA graph replays it. Stages and phases run on
//   across a CTA's jobs.
// Must not: choose the jobs' order or size (the plan did).
#pragma once

#include "mask.cuh"

namespace attnforge::fa3 {

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
  narrow_to_visible_keys<T>(p, w);
  w.slot = plan[p.off_work_partial + work];
  return w;
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

// A stage's k_full / v_full barrier expects one arrival per producer thread (kFullArrivals): a
// gathered tile's are its threads' cp.async copies, each counted as it lands (arrive-on .noinc, the
// form compute-sanitizer's synccheck follows: the counting form, which ptxas lowers to a
// transaction count per thread, it reports as a missing wait); a boxed or transposed tile's are one
// thread's, for all (arrive_for_all).
template <typename T>
constexpr uint32_t kFullArrivals = T::kProducerThreads;

__device__ __forceinline__ void arrive_count(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(common::smem_addr(bar)), "r"(count)
               : "memory");
}

// One thread's arrival on `full` for all kArrivals, with `bytes` of TMA copies to come when non-zero.
template <uint32_t kArrivals>
__device__ __forceinline__ void arrive_for_all(uint64_t* full, uint32_t bytes = 0) {
  if (bytes != 0) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, bytes);
  } else {
    cutlass::arch::ClusterBarrier::arrive(full);
  }
  if constexpr (kArrivals > 1) arrive_count(full, kArrivals - 1);
}

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
  return {smem.q + b * T::kBlockM * T::kTileDimQK, &smem.q_full[b], &smem.q_empty[b],
          uint32_t(item / T::kQBuffers) & 1};
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

}  // namespace attnforge::fa3
