// Role: copy the pages a prefill plan reads, in page-table order, into one ragged K and one ragged
//   V tensor in the workspace. A prefill whose requests read each key from many q tiles then runs
//   the ragged kernel, whose tiles are whole TMA boxes, instead of resolving page ids for every
//   tile of every q tile; the copy is paid once per key.
// Contract: grid = (gather_blocks(args), 2), block = kGatherThreads; blockIdx.y 0 copies K, 1 V.
//   Gathered row r (of pages * page_size) is row r % page_size of page page_ids[r / page_size],
//   stored [row][head][row_bytes] densely, so a 16-byte chunk's index is its byte offset / 16.
//   A page id outside [0, cache_pages) is never read: its rows become all ones (0xFF bytes, a NaN
//   in bf16, fp16, e4m3 and e5m2 alike), so every q row reading them comes out NaN, and the plan's
//   bad-page bit is raised, as the paged kernels do.
//   PDL (pdl.cuh): waits before reading the page table; its loads issued, lets the prefill launch.
// Must not: read past the plan's pages, or assume anything of the cache's strides but 16-byte
//   alignment (the paged kernels' TMA maps and cp.async copies need it too).
#pragma once

#include <cstdint>

#include "../host/launch.h"
#include "math.cuh"
#include "pdl.cuh"
#include "plan_image.cuh"

namespace attnforge::common {

// One cache tensor and its gathered copy; strides and row_bytes in bytes.
struct GatherTensor {
  const char* src;  // the paged cache (NHD or HND: any page, token and head strides)
  char* dst;        // [pages * page_size, heads, row_bytes / element size]
  int64_t page_stride, token_stride, head_stride;
  int32_t row_bytes;  // one head's row: head dim * element size, a multiple of 16
};

struct GatherPagesArgs {
  const int32_t* page_ids;  // [pages]: the plan's pages in order
  int32_t* plan;            // the plan image, whose error slot takes the bad-page bit
  int32_t pages, page_size, heads, cache_pages;
  GatherTensor k, v;
};

// The kernel's divisors, built on the host: building one is a 64-bit division (a few hundred
// instructions), where each thread copies only 64 bytes.
struct GatherDivisors {
  FastDivmod k_chunks, v_chunks;  // 16-byte chunks per head row
  FastDivmod heads, page_size;
};

constexpr int kGatherThreads = 256;
constexpr int kGatherChunksPerThread = 4;  // 16-byte loads each thread has in flight

__global__ void __launch_bounds__(kGatherThreads)
    gather_pages_kernel(const __grid_constant__ GatherPagesArgs a, const __grid_constant__ GatherDivisors d) {
  wait_for_prior_grids();  // PDL: the cache and the page table may be the previous kernel's output
  const bool is_k = blockIdx.y == 0;
  const GatherTensor& t = is_k ? a.k : a.v;
  const FastDivmod& by_chunks = is_k ? d.k_chunks : d.v_chunks;
  const int total = a.pages * a.page_size * a.heads * int(by_chunks.divisor);
  const int first = blockIdx.x * kGatherThreads * kGatherChunksPerThread + threadIdx.x;
  if (first >= total) return;
  int4 values[kGatherChunksPerThread];
  bool bad_page = false;
#pragma unroll
  for (int i = 0; i < kGatherChunksPerThread; ++i) {
    const int chunk = first + i * kGatherThreads;
    if (chunk >= total) break;
    int unit, column, row, head, page, in_page;
    by_chunks.divmod(chunk, unit, column);
    d.heads.divmod(unit, row, head);
    d.page_size.divmod(row, page, in_page);
    const int id = a.page_ids[page];
    const bool ok = static_cast<unsigned>(id) < static_cast<unsigned>(a.cache_pages);
    bad_page |= !ok;
    const char* src = t.src + id * t.page_stride + in_page * t.token_stride + head * t.head_stride + column * 16;
    values[i] = ok ? __ldcs(reinterpret_cast<const int4*>(src)) : make_int4(-1, -1, -1, -1);
  }
  allow_dependent_grids();
#pragma unroll
  for (int i = 0; i < kGatherChunksPerThread; ++i) {
    const int chunk = first + i * kGatherThreads;
    if (chunk >= total) break;
    reinterpret_cast<int4*>(t.dst)[chunk] = values[i];
  }
  if (bad_page) atomicOr(&a.plan[kPlanError], kPlanErrorBadPage);
}

// Blocks along x: enough for the larger of K's and V's chunks (their head dims may differ).
inline int gather_blocks(const GatherPagesArgs& a) {
  const int64_t rows = int64_t(a.pages) * a.page_size * a.heads;
  const int64_t chunks = rows * (a.k.row_bytes > a.v.row_bytes ? a.k.row_bytes : a.v.row_bytes) / 16;
  constexpr int64_t kPerBlock = kGatherThreads * kGatherChunksPerThread;
  return static_cast<int>((chunks + kPerBlock - 1) / kPerBlock);
}

inline cudaError_t launch_gather_pages(const GatherPagesArgs& a, cudaStream_t stream, bool pdl) {
  if (a.pages == 0) return cudaSuccess;
  if (int64_t(a.pages) * a.page_size * a.heads * (a.k.row_bytes + a.v.row_bytes) >= (int64_t(1) << 35))
    return cudaErrorInvalidValue;  // its chunk indices are int32 (plan() never asks for this)
  const GatherDivisors divisors{FastDivmod(a.k.row_bytes / 16), FastDivmod(a.v.row_bytes / 16), FastDivmod(a.heads),
                                FastDivmod(a.page_size)};
  return host::launch_kernel(gather_pages_kernel, dim3(gather_blocks(a), 2), dim3(kGatherThreads), 0, stream, pdl, a,
                             divisors);
}

}  // namespace attnforge::common
