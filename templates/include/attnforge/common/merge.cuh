// Role: merge the fp32 partial states of split requests into the final output, by base-2 LSE.
// Contract: grid = (batch_size, ceil(num_qo_heads / kHeadsPerBlock)), block = (kHeadDim / 4,
//   kHeadsPerBlock). Request r owns partial slots [partial_indptr[r], partial_indptr[r + 1]);
//   an empty range means the decode kernel already wrote o/lse for r, and the merge skips it.
//   State algebra (FLASHINFER.md 4.5): o = sum 2^(s_i - M) o_i / sum 2^(s_i - M),
//   lse = M + log2(sum 2^(s_i - M)); all-empty inputs give o = 0, lse = -inf.
// Must not: read anything but the partial buffers and the plan.
#pragma once

#include <cstdint>

#include "math.cuh"
#include "plan_image.cuh"
#include "vec.cuh"

namespace attnforge::common {

template <typename Params, typename DTypeO, int kHeadDim>
__global__ void merge_partials_kernel(const __grid_constant__ Params p) {
  constexpr int kCols = 4;  // fp32 columns per thread: one float4 load
  const int32_t* plan = static_cast<const int32_t*>(p.plan);
  const int request = blockIdx.x;
  const int qo_head = blockIdx.y * blockDim.y + threadIdx.y;
  if (qo_head >= p.num_qo_heads) return;
  const int first = plan[p.off_partial_indptr + request];
  const int last = plan[p.off_partial_indptr + request + 1];
  if (first == last) return;

  float m = kNegInf, d = 0.f;
  float acc[kCols] = {};
  bool poisoned = false;  // a chunk that read a bad page id: the whole row must come out NaN
  for (int slot = first; slot < last; ++slot) {
    const int64_t row = int64_t(slot) * p.num_qo_heads + qo_head;
    const float s = static_cast<const float*>(p.tmp_s)[row];
    poisoned |= isnan(s);
    const float m_new = fmaxf(m, s);
    if (m_new == kNegInf) continue;
    const float a = fast_exp2(m - m_new);
    const float b = fast_exp2(s - m_new);
    const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(p.tmp_v) + row * kHeadDim + threadIdx.x * kCols);
    acc[0] = acc[0] * a + v.x * b;
    acc[1] = acc[1] * a + v.y * b;
    acc[2] = acc[2] * a + v.z * b;
    acc[3] = acc[3] * a + v.w * b;
    d = d * a + b;
    m = m_new;
  }
  const float inv_d = poisoned ? NAN : (d > 0.f ? 1.f / d : 0.f);
  DTypeO* o_row = static_cast<DTypeO*>(p.o) + request * p.o_stride_n + qo_head * p.o_stride_h + threadIdx.x * kCols;
#pragma unroll
  for (int c = 0; c < kCols; ++c) o_row[c] = static_cast<DTypeO>(acc[c] * inv_d);
  if (p.lse != nullptr && threadIdx.x == 0) {
    static_cast<float*>(p.lse)[int64_t(request) * p.num_qo_heads + qo_head] =
        poisoned ? NAN : (d > 0.f ? m + log2f(d) : kNegInf);
  }
}

template <typename Params, typename DTypeO, int kHeadDim>
cudaError_t launch_merge_partials(const Params& p, cudaStream_t stream) {
  constexpr int kHeadsPerBlock = 4;
  const dim3 grid(p.batch_size, (p.num_qo_heads + kHeadsPerBlock - 1) / kHeadsPerBlock);
  const dim3 block(kHeadDim / 4, kHeadsPerBlock);
  merge_partials_kernel<Params, DTypeO, kHeadDim><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attnforge::common
