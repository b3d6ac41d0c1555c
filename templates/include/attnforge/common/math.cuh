// Role: the fast math of online softmax in the base-2 domain.
// Contract: exp2 of -inf is 0; log2 of 0 is -inf; tanh is the sm75+ hardware approximation.
// Must not: hold state; softmax bookkeeping lives in the kernels.
#pragma once

#include <cmath>
#include <cstdint>

namespace attnforge::common {

constexpr float kNegInf = -INFINITY;
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): natural-log logits to base 2

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

// The largest power of two s with max_abs * s <= bound, for scaling values into a narrower type's
// range exactly (1 when max_abs is 0). Masking a positive normal float to its exponent bits rounds
// it down to a power of two; the clamp keeps a near-zero max_abs from asking for an infinite one.
__device__ __forceinline__ float pow2_scale_within(float bound, float max_abs) {
  const float room = max_abs > 0.f ? fminf(bound / max_abs, 0x1p100f) : 1.f;
  return __uint_as_float(__float_as_uint(room) & 0x7f800000u);
}

// Sum / max over the kLanes lanes l ^ (kStride * i), i < kLanes: lanes that differ only in the
// lane-index bits [kStride, kStride * kLanes). kStride = 1 reduces over consecutive lanes.
template <int kLanes, int kStride = 1>
__device__ __forceinline__ float lane_group_sum(float x) {
#pragma unroll
  for (int offset = kStride; offset < kStride * kLanes; offset *= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <int kLanes, int kStride = 1>
__device__ __forceinline__ float lane_group_max(float x) {
#pragma unroll
  for (int offset = kStride; offset < kStride * kLanes; offset *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Reduce-scatter by recursive halving over the kLanes consecutive lanes that share kValues dot
// products (each lane holding its columns' partial sums): kValues - kValues / kScatter shuffles
// where a butterfly all-reduce of every value needs kValues * log2(kLanes).
//   kScatter = min(kValues, kLanes) lanes split the values; the other kLanes / kScatter lanes
//   finish the same values with a butterfly and hold copies of them.
// Contract: lane l owns items [own, own + kPerLane) with kPerLane = kValues / kScatter and
// own = (l % kLanes) / (kLanes / kScatter) * kPerLane; slot i of `x` must hold the lane's partial
// sum of item i ^ own. Then every step keeps the first half of the live slots and adds the
// partner's second half, which holds the same items (no selects), and on return x[i],
// i < kPerLane, is the full sum of item own + i. Slots >= kPerLane are left undefined.
template <int kLanes, int kValues>
__device__ __forceinline__ void lane_group_reduce_scatter(float (&x)[kValues]) {
  constexpr int kScatter = kValues < kLanes ? kValues : kLanes;
#pragma unroll
  for (int step = 1; step < kScatter; step *= 2) {
    const int live = kValues / (2 * step);
#pragma unroll
    for (int i = 0; i < live; ++i) x[i] += __shfl_xor_sync(0xffffffffu, x[i + live], kLanes / (2 * step));
  }
  x[0] = lane_group_sum<kLanes / kScatter>(x[0]);
}

}  // namespace attnforge::common

namespace attnforge::common {

__host__ __device__ __forceinline__ int leading_zeros(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __clz(x);
#else
  return x == 0 ? 32 : __builtin_clz(x);
#endif
}

// n / d and n % d for a divisor fixed per CTA, by multiply-high (Granlund-Montgomery, round-up
// variant); exact for 0 <= n < 2^31. Built once per CTA, or on the host: the 64-bit division stays
// out of loops.
struct FastDivmod {
  uint32_t divisor, mul, shift;

  __host__ __device__ __forceinline__ explicit FastDivmod(int d) : divisor(d) {
    shift = 32 - leading_zeros(d - 1);
    mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ int div(int n) const { return (__umulhi(uint32_t(n), mul) + uint32_t(n)) >> shift; }
  __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
    q = div(n);
    r = n - q * int(divisor);
  }
};

}  // namespace attnforge::common
