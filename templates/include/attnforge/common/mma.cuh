// Role: the sm80 tensor-core vocabulary: ldmatrix fragment loads and mma.sync m16n8k16 with fp32
//   accumulation, for half and bf16 operands.
// Contract (PTX ISA "Matrix Fragments for mma.m16n8k16"): lane l holds
//   A (16x16, row-major):  a[0] = (r, c..c+1), a[1] = (r+8, c..), a[2] = (r, c+8..), a[3] = (r+8, c+8..)
//   B (16x8, k x n):       b[0] = (k = c..c+1, n = r), b[1] = (k = c+8.., n = r)
//   C (16x8, fp32):        c[0..1] = (r, c..c+1), c[2..3] = (r+8, c..c+1)
//   with r = l / 4 and c = 2 * (l % 4). Every register holds two 16-bit elements.
// Must not: know about attention or shared-memory layouts; callers pass per-lane addresses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace attnforge::common {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void store_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}

// Four 8x8 matrices; lane l gives the row address (shared window) of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) { ldmatrix_x4(r, smem_addr(row)); }

// As ldmatrix_x4, each matrix transposed: a row-major [k][n] tile becomes B fragments.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  ldmatrix_x4_trans(r, smem_addr(row));
}

// c += a * b for one m16n8k16 tile.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A register of two 16-bit ones in T (an MMA operand that sums the other one's rows).
template <typename T>
inline constexpr uint32_t kOnes2 = 0;
template <>
inline constexpr uint32_t kOnes2<half> = 0x3C003C00u;
template <>
inline constexpr uint32_t kOnes2<__nv_bfloat16> = 0x3F803F80u;

// Two fp32 values as one register of two 16-bit elements (lower address = x).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y);

template <>
__device__ __forceinline__ uint32_t pack2<half>(float x, float y) {
  const half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace attnforge::common
