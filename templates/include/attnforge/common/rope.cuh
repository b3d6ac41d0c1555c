// Role: llama-style rotary position embedding of one 16-byte cell pair, in fp32.
// Contract: non-interleaved halves. For head dim D and pair index i < D/2, element i and i + D/2 rotate
//   by angle pos * rcp_scale * rcp_theta^(2i/D):  (x, y) -> (x cos - y sin, y cos + x sin).
//   `lo` holds elements [first, first + 8) of the first half, `hi` the same of the second half.
// Must not: touch memory; callers load and store the cells.
#pragma once

namespace attnforge::common {

template <int kHeadDim>
__device__ __forceinline__ void rope_rotate(float (&lo)[8], float (&hi)[8], int pos, int first, float rcp_scale,
                                            float rcp_theta) {
  const float log2_rcp_theta = __log2f(rcp_theta);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float freq = rcp_scale * exp2f(log2_rcp_theta * (float(2 * (first + e)) / float(kHeadDim)));
    float sin_a, cos_a;
    // Accurate sincos: angles reach thousands of radians at long positions.
    sincosf(float(pos) * freq, &sin_a, &cos_a);
    const float x = lo[e], y = hi[e];
    lo[e] = x * cos_a - y * sin_a;
    hi[e] = y * cos_a + x * sin_a;
  }
}

}  // namespace attnforge::common
