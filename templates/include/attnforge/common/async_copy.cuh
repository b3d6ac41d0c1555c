// Role: the sm80 asynchronous global->shared copy (cp.async) and its group waits.
// Contract: 16-byte copies; an invalid source copies zeros (src-size 0) so masked rows are
// harmless, but the address must still be a valid pointer.
// Must not: issue anything but cp.async; synchronization across threads is the caller's job.
#pragma once

#include <cstdint>

namespace attnforge::common {

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  // .cg: bypass L1, the KV cache is streamed once.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace attnforge::common
