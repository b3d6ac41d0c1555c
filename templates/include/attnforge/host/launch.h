// Role: the one way a module launches a kernel: cudaLaunchKernelEx on the caller's stream, with
//   programmatic stream serialization (PDL) set to the run's enable_pdl.
// Contract: with pdl set, the kernel may begin before the previous kernel on the stream completes;
//   it must then wait (common/pdl.cuh) before touching global memory. plan()/run() set enable_pdl
//   only on sm90+ devices, where every module's kernels were compiled with those waits. Returns the
//   launch's cudaError_t. Captures into CUDA graphs (as a programmatic edge, CUDA 12.3+).
// Must not: synchronize.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace attnforge::host {

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;  // without PDL: a plain launch, as <<<>>> (and on any device)
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace attnforge::host
