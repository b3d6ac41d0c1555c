// Role: merge the fp32 partial states of split requests into the final output, by base-2 LSE.
// Contract: grid = (rows, ceil(num_qo_heads / kHeadsPerBlock)), block = (kHeadDim / kMergeCols,
//   kHeadsPerBlock). A row is one query token (a decode request, or a prefill query row); row i
//   owns the consecutive partial slots [row_indptr[i], row_indptr[i + 1]) of the plan image;
//   an empty range means the attention kernel already wrote o/lse for it, and the merge skips it.
//   State algebra (as FlashInfer's merge_state): o = sum 2^(s_i - M) o_i / sum 2^(s_i - M),
//   lse = M + log2(sum 2^(s_i - M)); all-empty inputs give o = 0, lse = -inf.
//   Attention sinks (with_sink): a sink is one more state, o = 0 and lse = sink * log2(e). It joins
//   each output row exactly once: in the attention kernel's epilogue for a row it writes to o, here
//   after a split row's partials are merged (the partials themselves never hold it).
//   PDL (pdl.cuh): launched right after the attention kernel that writes the partials, it waits for
//   it before reading the plan; its row range read, it lets the next kernel launch.
//   merge_partial_row is the merge itself, also run inside the fa2 decode kernel (fused merge).
// Must not: read anything but the partial buffers and the plan.
#pragma once

#include <cstdint>

#include "../host/launch.h"
#include "math.cuh"
#include "pdl.cuh"
#include "plan_image.cuh"
#include "vec.cuh"

namespace attnforge::common {

// A final row state (o normalized, base-2 lse) joined with the row's sink, a state of value 0 and
// lse sink2 = sink * log2(e) (the sink is a natural-log logit, in the units of the scaled scores):
// o' = o * scale, lse' = lse of both. Exact algebra, so applying it once per row after any merge
// order gives the same result. A row that saw no key (lse = -inf) gets o' = 0 and lse' = sink2; a
// sink of -inf changes nothing (scale 1, lse unchanged) and a NaN row stays NaN.
struct SinkJoin {
  float scale;  // multiplies the row's normalized o
  float lse;    // the row's base-2 lse, sink included
};

__device__ __forceinline__ SinkJoin with_sink(float lse, float sink) {
  const float sink2 = sink * kLog2e;
  const float m = fmaxf(lse, sink2);  // a NaN lse yields sink2 here; lse - m below keeps the NaN
  if (m == kNegInf) return {1.f, lse};  // neither saw anything: o stays 0, lse -inf
  // w, ws in [0, 1], one of them 1: w + ws in [1, 2], where the approximate MUFU forms are exact
  // to a few ulp (and exact for a sink of -inf: scale 1, lse unchanged).
  const float w = fast_exp2(lse - m), ws = fast_exp2(sink2 - m);
  return {__fdividef(w, w + ws), m + __log2f(w + ws)};
}

// What the merge reads and writes; each kernel family's entry fills it from its own params.
struct MergeArgs {
  const int32_t* plan;
  int32_t off_row_indptr;  // plan image offset of row_indptr[rows + 1]
  int32_t rows;
  int32_t num_qo_heads;
  const float* tmp_v;  // [slot, num_qo_heads, kHeadDim]
  const float* tmp_s;  // [slot, num_qo_heads]
  void* o;
  int64_t o_stride_n, o_stride_h;
  float* lse;  // [row, num_qo_heads], or null
  const float* sinks;  // [num_qo_heads] fp32 sink logits joined into each merged row, or null
};

// Slots a thread loads before it folds them in. A split row's partials were written by the kernel
// just before, so each load is an L2 round trip: folded slot by slot, a row of n slots was a chain
// of 2n of them (the v load waited on the s test), which dominated batch-1 decode. kMergeSlotBatch
// independent loads per round make it ceil(n / kMergeSlotBatch) rounds; 8 float4 + 8 floats stay
// within the registers of a 512-thread block (head dim 512).
constexpr int kMergeSlotBatch = 8;

// fp32 columns of o a merging thread takes: one float4 load of each partial. A head of kHeadDim
// columns takes kHeadDim / kMergeCols threads, from column kMergeCols * thread.
constexpr int kMergeCols = 4;

// Merges the partial slots [first, last) of one (row, qo_head) over the kMergeCols fp32 columns from
// `col`, joins the sink, and stores them to o (and lse, from the thread of column 0). The one merge
// both the standalone kernel and the decode kernel's fused merge run. Partials are read with __ldcg:
// in the fused merge other CTAs wrote them during this grid, so L1 may hold stale lines.
template <typename DTypeO, int kHeadDim>
__device__ __forceinline__ void merge_partial_row(const MergeArgs& p, int row_id, int qo_head, int first, int last,
                                                  int col) {
  float m = kNegInf, d = 0.f;
  float acc[kMergeCols] = {};
  bool poisoned = false;  // a chunk that read a bad page id: the whole row must come out NaN
  for (int base = first; base < last; base += kMergeSlotBatch) {
    float s[kMergeSlotBatch];
    float4 v[kMergeSlotBatch];
#pragma unroll
    for (int j = 0; j < kMergeSlotBatch; ++j) {  // all loads first: none waits on another
      const int64_t row = int64_t(base + j) * p.num_qo_heads + qo_head;
      const bool in = base + j < last;
      s[j] = in ? __ldcg(p.tmp_s + row) : kNegInf;
      v[j] = in ? __ldcg(reinterpret_cast<const float4*>(p.tmp_v + row * kHeadDim + col))
                : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float m_new = m;
#pragma unroll
    for (int j = 0; j < kMergeSlotBatch; ++j) {
      poisoned |= isnan(s[j]);
      m_new = fmaxf(m_new, s[j]);  // fmaxf drops a NaN; poisoned carries it
    }
    if (m_new == kNegInf) continue;  // every state so far is empty
    const float a = fast_exp2(m - m_new);
    acc[0] *= a; acc[1] *= a; acc[2] *= a; acc[3] *= a;
    d *= a;
#pragma unroll
    for (int j = 0; j < kMergeSlotBatch; ++j) {
      if (s[j] == kNegInf) continue;  // an empty state is the identity, whatever its v holds
      const float b = fast_exp2(s[j] - m_new);
      acc[0] = fmaf(v[j].x, b, acc[0]);
      acc[1] = fmaf(v[j].y, b, acc[1]);
      acc[2] = fmaf(v[j].z, b, acc[2]);
      acc[3] = fmaf(v[j].w, b, acc[3]);
      d += b;
    }
    m = m_new;
  }
  float inv_d = poisoned ? NAN : (d > 0.f ? 1.f / d : 0.f);
  float lse = poisoned ? NAN : (d > 0.f ? m + log2f(d) : kNegInf);
  if (p.sinks != nullptr) {  // the partials hold no sink: it joins the merged row here, once
    const SinkJoin joined = with_sink(lse, p.sinks[qo_head]);
    inv_d *= joined.scale;
    lse = joined.lse;
  }
  DTypeO* o_row = static_cast<DTypeO*>(p.o) + row_id * p.o_stride_n + qo_head * p.o_stride_h + col;
#pragma unroll
  for (int c = 0; c < kMergeCols; ++c) o_row[c] = static_cast<DTypeO>(acc[c] * inv_d);
  if (p.lse != nullptr && col == 0) p.lse[int64_t(row_id) * p.num_qo_heads + qo_head] = lse;
}

template <typename DTypeO, int kHeadDim>
__global__ void merge_partials_kernel(const __grid_constant__ MergeArgs p) {
  wait_for_prior_grids();  // PDL: the partials are the previous kernel's output
  const int row_id = blockIdx.x;
  const int qo_head = blockIdx.y * blockDim.y + threadIdx.y;
  if (qo_head >= p.num_qo_heads) return;
  const int first = p.plan[p.off_row_indptr + row_id];
  const int last = p.plan[p.off_row_indptr + row_id + 1];
  if (first == last) return;
  allow_dependent_grids();  // the next kernel still waits for this grid's completion to read o
  merge_partial_row<DTypeO, kHeadDim>(p, row_id, qo_head, first, last, threadIdx.x * kMergeCols);
}

template <typename DTypeO, int kHeadDim>
cudaError_t launch_merge_partials(const MergeArgs& p, cudaStream_t stream, bool pdl) {
  constexpr int kHeadsPerBlock = 4;
  const dim3 grid(p.rows, (p.num_qo_heads + kHeadsPerBlock - 1) / kHeadsPerBlock);
  const dim3 block(kHeadDim / kMergeCols, kHeadsPerBlock);
  return host::launch_kernel(merge_partials_kernel<DTypeO, kHeadDim>, grid, block, 0, stream, pdl, p);
}

}  // namespace attnforge::common
