// Role: named CTA barriers (bar.sync with an id and a thread count), for a subset of a CTA's warps
//   that must meet without stopping the others.
// Contract: id 0 is __syncthreads'; a caller owns the ids it passes and every one of `threads`
//   (a multiple of 32) threads reaches the barrier. The "memory" clobber orders shared-memory
//   accesses around it, as __syncthreads does.
// Must not: pick ids for callers.
#pragma once

namespace attnforge::common {

// The id is an immediate: with an id in a register ptxas reserves all 16 of the CTA's barriers.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0, "named barrier: ids 1-15, whole warps");
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

}  // namespace attnforge::common
