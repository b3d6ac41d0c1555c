// Role: programmatic dependent launch (PDL), device side: the two points a kernel marks when the
//   host launched it with cudaLaunchAttributeProgrammaticStreamSerialization (host/launch.h), so it
//   may start while the kernel before it on the stream is still finishing.
// Contract: a kernel calls wait_for_prior_grids() in every thread before its first global read of
//   anything an earlier kernel may write (q, K/V, the plan image, partials, the job counter) and
//   before its first global write; it calls allow_dependent_grids() once its main loop is done, so
//   the next kernel's CTAs can be launched and run their own prologue meanwhile (they still wait for
//   this grid to complete and flush before touching memory). Both are no-ops when the launch was not
//   programmatic, and compile to nothing before sm_90 (no such instructions there; PDL is off).
// Must not: be skipped on an early-exit path that reads or writes global memory first.
#pragma once

namespace attnforge::common {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace attnforge::common
