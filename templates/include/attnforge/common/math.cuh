// Role: the fast math of online softmax in the base-2 domain.
// Contract: exp2 of -inf is 0; log2 of 0 is -inf; tanh is the sm75+ hardware approximation.
// Must not: hold state; softmax bookkeeping lives in the kernels.
#pragma once

#include <cmath>

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
