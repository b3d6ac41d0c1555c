// Role: 16-byte vector moves between global/shared memory and fp32 registers.
// Contract: a "vector" is one uint4 holding 8 16-bit elements (half or __nv_bfloat16).
// Must not: know about attention; it is plain data movement and conversion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace attnforge::common {

template <typename T>
struct Vec16;

template <>
struct Vec16<half> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void to_float(const uint4& raw, float (&out)[8]) {
    const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static uint4 from_float(const float (&in)[8]) {
    uint4 raw;
    half2* h = reinterpret_cast<half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
    return raw;
  }
};

template <>
struct Vec16<__nv_bfloat16> {
  static constexpr int kElems = 8;
  // A bf16 is the high half of an fp32: a shift or a mask per element (the intrinsic
  // __bfloat1622float2 spends three instructions per pair, and decode converts every K/V element).
  __device__ __forceinline__ static void to_float(const uint4& raw, float (&out)[8]) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static uint4 from_float(const float (&in)[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    return raw;
  }
};

}  // namespace attnforge::common
