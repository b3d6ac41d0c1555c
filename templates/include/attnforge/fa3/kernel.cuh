// Role: the FA3 prefill kernel as a composition (producer warpgroup + consumer warpgroups over a
//   persistent job loop), its barriers' initialization, the TMA descriptors encoded per launch,
//   and the launch with its choice of instantiation (decode items, V transposed ahead).
// Contract: launch_prefill<T>(params, stream) picks the instantiation for the plan and calls its
//   launch_instance<U>, which launches min(work_capacity x num_kv_heads, max_ctas) CTAs on the
//   caller's stream and returns the launch's cudaError_t; prefill_occupancy gives the CTAs per SM
//   that plan() sizes max_ctas with. A module compiles each launch_instance<U> in a translation
//   unit of its own (declared `extern template` where launch_prefill is), so nvcc builds them in
//   parallel.
//   PDL (common/pdl.cuh): barrier init and descriptor prefetch run before the wait; every thread
//   waits before the first plan read; the producer, out of jobs, lets the next kernel launch.
// Must not: synchronize or allocate; decide the schedule (the plan did).
#pragma once

#include "producer.cuh"
#include "consumer.cuh"

namespace attnforge::fa3 {

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

  // Everything up to the PDL wait touches only shared memory and the parameters: it overlaps the
  // previous kernel's tail when the launch is programmatic.
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
      Barrier::init(&smem.k_full[s], kFullArrivals<T>);  // each gathering thread's, or one thread's for all
      Barrier::init(&smem.v_full[s], kFullArrivals<T>);
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
  // PDL: the plan (and its job counter), Q and K/V may come from the kernel before; every thread
  // waits, so the producer's loads and the consumers' plan reads and stores all follow it.
  common::wait_for_prior_grids();
  if (int(blockIdx.x) >= num_jobs_of(p)) return;  // more CTAs than jobs (a static CUDA-graph grid)
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
    // PDL: this CTA's loads are issued and its job count taken; the next kernel may launch (its
    // CTAs take SMs as these exit).
    common::allow_dependent_grids();
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
      host::encode_pages_map<kBytes, T::kLineBytesQK>(&args.k_pages, p.k, T::kHeadDimQK, page_size, p.num_kv_heads, pages,
                                     p.kv_stride_token, p.kv_stride_head, k_page_stride, args.box_rows);
  if (err != cudaSuccess) return err;
  return host::encode_pages_map<kBytes, T::kLineBytesVO>(&args.v_pages, p.v, T::kHeadDimVO, page_size, p.num_kv_heads, pages,
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
  const cudaError_t err = host::encode_q_map<kBytes, T::kLineBytesQK>(&args.q_rows, p.q, T::kHeadDimQK, p.num_qo_heads, p.q_tokens,
                                                     p.q_stride_h, p.q_stride_n, p.group_size,
                                                     T::kBlockM / p.group_size);
  args.q_boxed = err == cudaSuccess;
  return cudaSuccess;  // a layout the driver refuses is gathered
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
cudaError_t launch_instance(const typename T::Params& p, cudaStream_t stream) {
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
  return host::launch_kernel(prefill_kernel<T>, dim3(grid), dim3(T::kThreads), T::kSmemBytes, stream, p.enable_pdl != 0,
                             args);
}

// The instantiation a plan runs on: T itself, or one of its variants (V transposed ahead, decode items).
template <typename T>
cudaError_t launch_prefill(const typename T::Params& p, cudaStream_t stream) {
  static_assert(!T::kVtAhead && !T::kDecodeItems, "fa3 launch_prefill: takes the prefill instantiation, not a variant");
  if constexpr (T::kHasVtAhead) {
    // Ragged K shorter than a tile is gathered, which the kernel with V transposed ahead never
    // expects (GatheredOperands): such a launch transposes V itself.
    if (p.v_transposed != nullptr && (T::kPagedKV || p.num_pages >= T::kBlockN)) {
      return launch_instance<typename T::WithVtAhead>(p, stream);
    }
  }
  if constexpr (T::kHasDecodeItems) {
    // One query token per request: a decode instantiation (items of <= 64 rows leave consumer
    // warpgroup 1 free to transpose V; it checks each item's rows itself). Items of at most 8
    // rows, which the plan vouches for (one_token_requests), run with the keys along M.
    if constexpr (T::kHasKeysAlongM) {
      if (p.one_token_requests && p.group_size <= 8) {
        return launch_instance<typename T::template WithDecodeRows<8>>(p, stream);
      }
    }
    // The plan's q tiles are this kernel's: the decode instantiation (two consumer warpgroups) takes
    // them where they are its own too, or where a request's rows fit in its one tile.
    using Decode = typename T::template WithDecodeRows<64>;
    const bool decode_tiles = T::kBlockM == Decode::kBlockM || p.group_size <= Decode::kBlockM;
    if (p.q_tokens == p.batch_size && decode_tiles) return launch_instance<Decode>(p, stream);
  }
  return launch_instance<T>(p, stream);
}

}  // namespace attnforge::fa3
