// Role: 16-byte vector moves between global/shared memory and fp32 registers.
// Contract: a "vector" is one uint4 holding kElems elements: 8 of a 16-bit type (half,
// __nv_bfloat16) or 16 of an fp8 type (__nv_fp8_e4m3, __nv_fp8_e5m2; read-only: no kernel writes
// fp8; an fp8 vector widens to fp32, or pair by pair to half2).
// Must not: know about attention; it is plain data movement and conversion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <type_traits>

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

// fp8 -> fp32 through fp16, which holds every e4m3 and e5m2 value exactly (subnormals included).
// Each 32-bit word of four fp8 bytes becomes two half2 by a byte permute that puts each byte in
// the high byte of a 16-bit lane: for e5m2 that already is the fp16 of the same value (e5m2 is
// fp16 without its low mantissa byte), NaN and inf included.
__device__ __forceinline__ uint32_t fp8_pair_to_high_bytes(uint32_t word, int pair) {
  return __byte_perm(word, 0u, pair == 0 ? 0x1404u : 0x3424u);  // bytes (2p, 2p+1) -> lanes (0, 1)
}

template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ half2 fp8_pair_to_half2(uint32_t word, int pair);

template <>
__device__ __forceinline__ half2 fp8_pair_to_half2<__NV_E5M2>(uint32_t word, int pair) {
  const uint32_t bits = fp8_pair_to_high_bytes(word, pair);
  return *reinterpret_cast<const half2*>(&bits);
}

template <>
__device__ __forceinline__ half2 fp8_pair_to_half2<__NV_E4M3>(uint32_t word, int pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // One cvt per pair on sm89+. Naming the word's 16-bit halves in PTX (rather than shifting the
  // high pair down in C++) lets ptxas read the high half in place: no shift per word.
  uint32_t bits;
  if (pair == 0) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(bits) : "r"(word));
  } else {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(bits) : "r"(word));
  }
  return *reinterpret_cast<const half2*>(&bits);
#else
  // No fp8 cvt before sm89, and the library's emulation costs registers the decode kernel has not
  // got. Moving e4m3's 4 exponent and 3 mantissa bits below fp16's exponent field, sign kept,
  // gives fp16 = value * 2^-8 (the biases differ by 8), normals and subnormals alike; * 2^8 is
  // exact. (e4m3's NaN, 0x7f, would read as 480: a KV cache holds no NaN.)
  const uint32_t high = fp8_pair_to_high_bytes(word, pair);
  const uint32_t bits = (high & 0x80008000u) | ((high >> 1) & 0x3f803f80u);
  return __hmul2(*reinterpret_cast<const half2*>(&bits), __floats2half2_rn(256.f, 256.f));
#endif
}

template <__nv_fp8_interpretation_t kFormat>
struct Fp8Vec16 {
  static constexpr int kElems = 16;
  static constexpr float kMaxFinite = kFormat == __NV_E4M3 ? 448.f : 57344.f;  // bounds fp16 sums of these
  // Exact, and one conversion per pair: for kernels that do their math in packed half2.
  __device__ __forceinline__ static void to_half2(const uint4& raw, half2 (&out)[8]) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = fp8_pair_to_half2<kFormat>(words[i / 2], i % 2);
  }
  // The low (pair 0) or high (pair 1) two bytes of `word`, as half2 bits.
  __device__ __forceinline__ static uint32_t pair_to_half2_bits(uint32_t word, int pair) {
    const half2 h = fp8_pair_to_half2<kFormat>(word, pair);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ __forceinline__ static void to_float(const uint4& raw, float (&out)[16]) {
    half2 pairs[8];
    to_half2(raw, pairs);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __half22float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <>
struct Vec16<__nv_fp8_e4m3> : Fp8Vec16<__NV_E4M3> {};

template <>
struct Vec16<__nv_fp8_e5m2> : Fp8Vec16<__NV_E5M2> {};

// kN consecutive elements starting 16-byte aligned, as fp32: kN / kElems vector loads. Lets a
// kernel size its per-thread columns by one dtype (the KV cache's) and move another (q, o) in them.
template <typename T, int kN>
__device__ __forceinline__ void load_float(const T* src, float (&out)[kN]) {
  constexpr int kElems = Vec16<T>::kElems;
  static_assert(kN % kElems == 0, "load_float: a whole number of 16-byte vectors");
  const uint4* vectors = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < kN / kElems; ++i) {
    Vec16<T>::to_float(vectors[i], *reinterpret_cast<float(*)[kElems]>(out + i * kElems));
  }
}

// 8 consecutive elements starting at a multiple of 8, as fp32: half a 16-byte vector of an fp8
// type. For RoPE, which pairs 8-element groups half a head dim apart.
template <typename T>
__device__ __forceinline__ void load_float8(const T* src, float (&out)[8]) {
  if constexpr (Vec16<T>::kElems == 8) {
    Vec16<T>::to_float(*reinterpret_cast<const uint4*>(src), out);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t bits = Vec16<T>::pair_to_half2_bits(i < 2 ? raw.x : raw.y, i % 2);
      const float2 f = __half22float2(*reinterpret_cast<const half2*>(&bits));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

template <typename T, int kN>
__device__ __forceinline__ void store_float(T* dst, const float (&in)[kN]) {
  constexpr int kElems = Vec16<T>::kElems;
  static_assert(kN % kElems == 0, "store_float: a whole number of 16-byte vectors");
  uint4* vectors = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < kN / kElems; ++i) {
    vectors[i] = Vec16<T>::from_float(*reinterpret_cast<const float(*)[kElems]>(in + i * kElems));
  }
}

}  // namespace attnforge::common
