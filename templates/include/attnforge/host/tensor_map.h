// Role: TMA descriptors (CUtensorMap) for the FA3 kernels, encoded on the host before a launch.
// Contract: a K or V cache of 16-bit elements with arbitrary token, head and page strides
//   (elements; 16-byte multiples, 16-byte aligned base: run() checks both) becomes a 4-D map of
//   (dim, row in page, head, page) whose box is (64 elements = one 128-byte swizzle line,
//   box_rows rows, 1 head, 1 page), 128B-swizzled exactly like CuTe's GMMA SW128 atoms tiled
//   row-first. Rows past the map read as zeros.
// Must not: link libcuda (the module uses the static runtime): CUTLASS's wrapper reaches the
//   driver's encoder through cudaGetDriverEntryPointByVersion.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cutlass/cuda_host_adapter.hpp>

#include <cstdint>

namespace attnforge::host {

inline constexpr int kTmaBoxDim = 64;  // 16-bit elements in one 128-byte swizzle line

// cudaErrorInvalidValue when the driver refuses the layout (or has no encoder).
inline cudaError_t encode_pages_map(CUtensorMap* map, const void* base, int64_t dim, int64_t page_size, int64_t heads,
                                    int64_t pages, int64_t token_stride, int64_t head_stride, int64_t page_stride,
                                    int box_rows) {
  constexpr int64_t kElementBytes = 2;
  const cuuint64_t sizes[4] = {cuuint64_t(dim), cuuint64_t(page_size), cuuint64_t(heads), cuuint64_t(pages)};
  const cuuint64_t strides[3] = {cuuint64_t(token_stride * kElementBytes), cuuint64_t(head_stride * kElementBytes),
                                 cuuint64_t(page_stride * kElementBytes)};
  const cuuint32_t box[4] = {kTmaBoxDim, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult result = cutlass::call_cuTensorMapEncodeTiled(
      map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), sizes, strides, box, unit,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace attnforge::host
