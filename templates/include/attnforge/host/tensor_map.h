// Role: TMA descriptors (CUtensorMap) for the FA3 kernels, encoded on the host before a launch.
// Contract: a [rows, heads, dim] tensor of 16-bit elements with arbitrary token and head strides
//   (elements; 16-byte multiples, 16-byte aligned base: run() checks both) becomes a 3-D map of
//   (dim, heads, rows) whose box is (64 elements = one 128-byte swizzle line, 1 head, box_rows
//   rows), 128B-swizzled exactly like CuTe's GMMA K-major SW128 atom tiled row-first. Rows past
//   `rows` read as zeros.
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
inline cudaError_t encode_rows_map(CUtensorMap* map, const void* base, int64_t rows, int64_t heads, int64_t dim,
                                   int64_t token_stride, int64_t head_stride, int box_rows) {
  constexpr int64_t kElementBytes = 2;
  const cuuint64_t sizes[3] = {cuuint64_t(dim), cuuint64_t(heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(head_stride * kElementBytes), cuuint64_t(token_stride * kElementBytes)};
  const cuuint32_t box[3] = {kTmaBoxDim, 1, cuuint32_t(box_rows)};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult result = cutlass::call_cuTensorMapEncodeTiled(
      map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), sizes, strides, box, unit,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace attnforge::host
