// Role: the FA2 kernels' position-encoding vocabulary, shared by prefill and decode: the tags
//   (PosEncoding, the spec's pos_encoding) and each query head's ALiBi slope. The RoPE rotation
//   itself is common::rope_rotate (common/rope.cuh).
//
// Contract: alibi_slope matches attnforge.reference.alibi_slopes (FlashInfer's get_alibi_slopes).
//
// Must not: touch memory.
#pragma once

namespace attnforge::fa2 {

enum PosEncoding : int { kPosNone = 0, kPosRopeLlama = 1, kPosAlibi = 2 };

// ALiBi slope of query head h (FlashInfer get_alibi_slopes): 2^(-8(h+1)/n) for the first n = 2^floor(log2 Hq)
// heads, then the odd multiples 2^(-4(2(h-n)+1)/n).
__device__ __forceinline__ float alibi_slope(int head, int num_heads) {
  const int n = 1 << (31 - __clz(num_heads));
  return head < n ? exp2f(-8.f * float(head + 1) / float(n)) : exp2f(-4.f * float(2 * (head - n) + 1) / float(n));
}

}  // namespace attnforge::fa2
