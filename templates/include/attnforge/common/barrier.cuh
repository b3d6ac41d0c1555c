// Role: named CTA barriers (bar.sync with an id and a thread count), for a subset of a CTA's warps
//   that must meet without stopping the others.
// Contract: id 0 is __syncthreads'; a caller owns the ids it passes and every one of `threads`
//   (a multiple of 32) threads reaches the barrier. The "memory" clobber orders shared-memory
//   accesses around it, as __syncthreads does.
// Must not: pick ids for callers.
#pragma once

namespace attnforge::common {

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace attnforge::common
