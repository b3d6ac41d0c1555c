// Role: the fast math of online softmax in the base-2 domain.
// Contract: exp2 of -inf is 0; log2 of 0 is -inf; tanh is the sm75+ hardware approximation.
// Must not: hold state; softmax bookkeeping lives in the kernels.
#pragma once

#include <cmath>
#include <cstdint>

namespace attnforge::common {

constexpr float kNegInf = -INFINITY;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Sum over the `kLanes` consecutive lanes of a warp that share one dot product.
template <int kLanes>
__device__ __forceinline__ float lane_group_sum(float x) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace attnforge::common

namespace attnforge::common {

// n / d and n % d for a divisor fixed per CTA, by multiply-high (Granlund-Montgomery, round-up
// variant); exact for 0 <= n < 2^31. Built once per CTA: the 64-bit division stays out of loops.
struct FastDivmod {
  uint32_t divisor, mul, shift;

  __device__ __forceinline__ explicit FastDivmod(int d) : divisor(d) {
    shift = 32 - __clz(d - 1);
    mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ int div(int n) const { return (__umulhi(uint32_t(n), mul) + uint32_t(n)) >> shift; }
  __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
    q = div(n);
    r = n - q * int(divisor);
  }
};

}  // namespace attnforge::common
