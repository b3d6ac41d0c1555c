// Role: TMA descriptors (CUtensorMap) for the FA3 kernels, encoded on the host before a launch.
// Contract: a K or V cache of 16-bit or 8-bit elements with arbitrary token, head and page strides
//   (elements; 16-byte multiples, 16-byte aligned base: run() checks both) becomes a 4-D map of
//   (dim, row in page, head, page) whose box is (one swizzle line of kLineBytes = 128, 64 or 32,
//   box_rows rows, 1 head, 1 page), swizzled exactly like CuTe's GMMA atoms of that line tiled
//   row-first. Rows past the map read as zeros. A query tensor becomes a 3-D map of (dim, head,
//   token) whose box is a q tile's packed rows (its caller checks strides and alignment).
// Must not: link libcuda (the module uses the static runtime): the driver's encoder is reached
//   through cudaGetDriverEntryPointByVersion, looked up once per process (every run() encodes).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace attnforge::host {

inline constexpr int kTmaBoxBytes = 128;  // the widest swizzle line

// The TMA swizzle that matches CuTe's GMMA atom of a kLineBytes line (Swizzle<3|2|1, 4, 3>).
template <int kLineBytes>
inline constexpr CUtensorMapSwizzle kSwizzleOfLine =
    kLineBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : kLineBytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B;

using TensorMapEncoder = decltype(&cuTensorMapEncodeTiled);

// The driver's cuTensorMapEncodeTiled (the 12.0 ABI), or null when the driver has none.
inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<TensorMapEncoder>(fn) : nullptr;
  }();
  return encoder;
}

// A rank-kRank map of kElementBytes elements whose box's first extent is one kLineBytes swizzle
// line; cudaErrorInvalidValue when the driver refuses the layout (or has no encoder). strides:
// bytes of dims 1.. (dim 0 is contiguous).
template <int kElementBytes, int kRank, int kLineBytes>
inline cudaError_t encode_lines_map(CUtensorMap* map, const void* base, const cuuint64_t (&sizes)[kRank],
                                    const cuuint64_t (&strides)[kRank - 1], const cuuint32_t (&box)[kRank]) {
  static_assert(kElementBytes == 1 || kElementBytes == 2, "tensor map: 8-bit or 16-bit elements");
  static_assert(kLineBytes == 128 || kLineBytes == 64 || kLineBytes == 32, "tensor map: 128, 64 or 32-byte lines");
  constexpr auto kType = kElementBytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  cuuint32_t unit[kRank];
  for (auto& u : unit) u = 1;
  const TensorMapEncoder encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorInvalidValue;
  const CUresult result = encode(
      map, kType, kRank, const_cast<void*>(base), sizes, strides, box, unit,
      CU_TENSOR_MAP_INTERLEAVE_NONE, kSwizzleOfLine<kLineBytes>, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <int kElementBytes, int kLineBytes>
inline cudaError_t encode_pages_map(CUtensorMap* map, const void* base, int64_t dim, int64_t page_size, int64_t heads,
                                    int64_t pages, int64_t token_stride, int64_t head_stride, int64_t page_stride,
                                    int box_rows) {
  const cuuint64_t sizes[4] = {cuuint64_t(dim), cuuint64_t(page_size), cuuint64_t(heads), cuuint64_t(pages)};
  const cuuint64_t strides[3] = {cuuint64_t(token_stride * kElementBytes), cuuint64_t(head_stride * kElementBytes),
                                 cuuint64_t(page_stride * kElementBytes)};
  const cuuint32_t box[4] = {kLineBytes / kElementBytes, cuuint32_t(box_rows), 1, 1};
  return encode_lines_map<kElementBytes, 4, kLineBytes>(map, base, sizes, strides, box);
}

// Q [tokens, heads, dim] as (dim, head, token), boxed `group` heads x box_tokens tokens: packed
// rows (token, head in group) in order, one kLineBytes line each.
template <int kElementBytes, int kLineBytes>
inline cudaError_t encode_q_map(CUtensorMap* map, const void* base, int64_t dim, int64_t heads, int64_t tokens,
                                int64_t head_stride, int64_t token_stride, int group, int box_tokens) {
  const cuuint64_t sizes[3] = {cuuint64_t(dim), cuuint64_t(heads), cuuint64_t(tokens)};
  const cuuint64_t strides[2] = {cuuint64_t(head_stride * kElementBytes), cuuint64_t(token_stride * kElementBytes)};
  const cuuint32_t box[3] = {kLineBytes / kElementBytes, cuuint32_t(group), cuuint32_t(box_tokens)};
  return encode_lines_map<kElementBytes, 3, kLineBytes>(map, base, sizes, strides, box);
}

// fa3 fp8 V transposed ahead, [heads][blocks][dim][block_keys] bytes, as (key in block, dim,
// block, head), boxed a whole block: its keys one 128-byte line, each of its dims a row.
inline cudaError_t encode_blocks_map(CUtensorMap* map, const void* base, int64_t dim, int64_t block_keys,
                                     int64_t blocks, int64_t heads) {
  const cuuint64_t sizes[4] = {cuuint64_t(block_keys), cuuint64_t(dim), cuuint64_t(blocks), cuuint64_t(heads)};
  const cuuint64_t strides[3] = {cuuint64_t(block_keys), cuuint64_t(block_keys * dim), cuuint64_t(block_keys * dim * blocks)};
  const cuuint32_t box[4] = {cuuint32_t(block_keys), cuuint32_t(dim), 1, 1};
  return encode_lines_map<1, 4, kTmaBoxBytes>(map, base, sizes, strides, box);
}

}  // namespace attnforge::host
