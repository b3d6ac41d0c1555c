// Role: the FA2 prefill kernel's epilogue (store_rows): normalize each of a warp's rows by its
//   denominator and store o and lse, or the fp32 partial row of a request split over chunks.
//
// Contract:
//   - Direct (slot < 0): o in DTypeO at (qo_begin + token, qo_head), and the base-2 lse when p.lse
//     is set. Split (slot >= 0): fp32 o and lse at partial row slot + token * num_chunks[request],
//     which the merge kernel (common/merge.cuh) combines. A CTA stores its kSliceVO columns from
//     vo_first; the slices' lse are equal, slice 0 stores it.
//   - A direct row joins its attention sink (p.sinks, common::with_sink); a partial row does not
//     (the merge joins it). A row that saw no key stores o = 0, lse = -inf (before the sink); a CTA
//     that met a bad page id stores NaN.
//     Rows past the request's packed length store nothing.
//   - d is the row's whole denominator: the quad reduced and, for the column split, the warps
//     merged.
//
// Must not: apply k_scale / v_scale (the caller's), or write the plan's error word (the kernel does).
#pragma once

#include <cstdint>

#include "../common/math.cuh"
#include "../common/merge.cuh"
#include "../common/mma.cuh"

#include "prefill_traits.cuh"
#include "prefill_state.cuh"
#include "prefill_mask.cuh"

namespace attnforge::fa2 {

// Normalize and store this warp's rows: o/lse directly, or the fp32 partial slot of the chunk.
template <typename T>
__device__ __forceinline__ void store_rows(const typename T::Params& p, const PrefillRows& rows, const RowCoords<T>& rc,
                                           int kv_head, int warp_q, int slot, int vo_first,
                                           bool bad_page, PrefillState<T>& st) {
  using DTypeO = typename T::DTypeO;
  const int lane = threadIdx.x % 32;
  const int32_t* plan = static_cast<const int32_t*>(p.plan);
  const int num_chunks = slot >= 0 ? plan[p.off_num_chunks + rows.request] : 0;
  const bool lse_slice = vo_first == 0;
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = (warp_q * T::kMmaQ + mq) * 16 + rr * 8 + lane / 4;
      if (row >= rows.rows) continue;
      const int token = rc.token[mq][rr];
      const int qo_head = kv_head * p.group_size + (rows.row_begin + row - token * p.group_size);
      const float d = st.d[mq][rr];
      float inv_d = bad_page ? NAN : (d > 0.f ? 1.f / d : 0.f);
      float lse = bad_page ? NAN : (d > 0.f ? st.m[mq][rr] + log2f(d) : common::kNegInf);
      if (slot < 0) {
        if (p.sinks != nullptr) {
          const common::SinkJoin joined = common::with_sink(lse, static_cast<const float*>(p.sinks)[qo_head]);
          inv_d *= joined.scale;
          lse = joined.lse;
        }
        DTypeO* o_row = static_cast<DTypeO*>(p.o) + int64_t(rows.qo_begin + token) * p.o_stride_n +
                        int64_t(qo_head) * p.o_stride_h + vo_first;
#pragma unroll
        for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
          for (int pair = 0; pair < 2; ++pair) {
            const int e = o_pair_first<T>(rr, pair);
            *reinterpret_cast<uint32_t*>(o_row + o_col<T>(dv, e, lane)) =
                common::pack2<DTypeO>(st.o[mq][dv][e] * inv_d, st.o[mq][dv][e + kOPairStep<T>] * inv_d);
          }
        }
        if (p.lse != nullptr && lane % 4 == 0 && lse_slice) {
          static_cast<float*>(p.lse)[int64_t(rows.qo_begin + token) * p.num_qo_heads + qo_head] = lse;
        }
      } else {
        const int64_t prow = int64_t(slot + token * num_chunks) * p.num_qo_heads + qo_head;
        float* partial = static_cast<float*>(p.tmp_v) + prow * T::kHeadDimVO + vo_first;
#pragma unroll
        for (int dv = 0; dv < T::kMmaDVO; ++dv) {
#pragma unroll
          for (int pair = 0; pair < 2; ++pair) {
            const int e = o_pair_first<T>(rr, pair);
            *reinterpret_cast<float2*>(partial + o_col<T>(dv, e, lane)) =
                make_float2(st.o[mq][dv][e] * inv_d, st.o[mq][dv][e + kOPairStep<T>] * inv_d);
          }
        }
        if (lane % 4 == 0 && lse_slice) static_cast<float*>(p.tmp_s)[prow] = lse;
      }
    }
  }
}

}  // namespace attnforge::fa2
