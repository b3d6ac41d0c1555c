// Role: the FA2 decode kernel's tensor-core tile (DecodeTraits::kMmaTile): an fp8 KV cache read for
//   4 to 8 query heads, where the CUDA-core tile is issue-bound (it converts each K/V element once
//   per head group and multiplies it once per head in packed FMAs). Here a warp takes 16 rows of a
//   64-token tile as its own token lane (its own online softmax, merged after the kv loop like the
//   CUDA-core tile's token lanes) and runs mma.sync m16n8k16 in fp16 with fp32 accumulation, the
//   CTA's heads as the MMAs' N (8; rows past the CTA's heads are zero queries, never stored):
//     S^T (16 tokens x 8 heads) = K (16 x hd, A from the ring) . Q^T (hd x 8, B in registers);
//     O^T (hd x 8)             += V^T (hd x 16, A from the ring) . P^T (16 x 8, B through shared memory).
//   Every fp8 element is converted to fp16 (exactly, one cvt per pair) once per CTA.
// Contract (fragment layouts of common/mma.cuh; lane = (g, t) = (lane / 4, lane % 4)):
//   - the ring holds rows of 128 bytes placed by common::Swizzle128 (DecodeTraits::ring_element);
//   - K: lane (g, t) reads dims [hd/4 t, hd/4 (t + 1)) of rows g and g + 8, so k index 2t + {0, 1}
//     (+8) of k-step c is dim hd/4 t + 4c + {0, 1} ({2, 3}); q's B fragments follow the same order
//     (a dot product does not depend on the order of its dims);
//   - V: ldmatrix.trans hands out byte pairs (dims 2r, 2r + 1) of two tokens, so row r of dim chunk
//     ch's A is dim 16 ch + 2r and row r + 8 is dim 16 ch + 2r + 1 (share_mma_state undoes it).
// Must not: plan, copy or store results; the kernel owns the ring, the lane merge and the stores.
#pragma once

#include <cstdint>

#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/swizzle.cuh"
#include "../common/vec.cuh"

namespace attnforge::fa2 {

// q's B fragments: k-step c's b[c][0] holds dims 4c, 4c + 1 and b[c][1] dims 4c + 2, 4c + 3 of
// this lane's hd / 4, for head g; all of q times one power of two that puts its max |q| at most
// kMmaQueryBound (a bf16 q is then exact in fp16, and the products sum in fp32). unscale turns a
// sum into a base-2 logit.
template <int kKSteps>
struct MmaQuery {
  uint32_t b[kKSteps][2];
  float unscale;
};

constexpr float kMmaQueryBound = 0x1p14f;

// One warp's online softmax for heads 2t and 2t + 1: the max (shared by the lanes of one t), this
// lane's share of the denominator, and O^T's C fragments, one per 16-dim chunk.
template <int kChunks>
struct MmaState {
  float o[kChunks][4] = {};
  float m[2] = {common::kNegInf, common::kNegInf};
  float d[2] = {0.f, 0.f};
};

template <typename T>
__device__ __forceinline__ void load_query_mma(const typename T::Params& p, int request, int kv_head, int first_slot,
                                               int lane, MmaQuery<T::kMmaChunks>& q) {
  constexpr int kDims = T::kHeadDim / 4;
  const int g = lane / 4, t = lane % 4;
  float qf[kDims] = {};
  if (g < T::kHeadsPerCta) {
    const int qo_head = kv_head * p.group_size + min(first_slot + g, p.group_size - 1);
    const auto* q_row = static_cast<const typename T::DTypeQ*>(p.q) + request * p.q_stride_n + qo_head * p.q_stride_h;
    common::load_float(q_row + kDims * t, qf);
  }
  float max_abs = 0.f;
#pragma unroll
  for (int e = 0; e < kDims; ++e) max_abs = fmaxf(max_abs, fabsf(qf[e]));
  max_abs = common::lane_group_max<32>(max_abs);
  // As pack_query: the exponent bits of the room left round it down to a power of two.
  const float room = max_abs > 0.f ? fminf(kMmaQueryBound / max_abs, 0x1p100f) : 1.f;
  const float scale = __uint_as_float(__float_as_uint(room) & 0x7f800000u);
  q.unscale = p.score_scale / scale;
#pragma unroll
  for (int c = 0; c < T::kMmaChunks; ++c) {
    q.b[c][0] = common::pack2<half>(qf[4 * c] * scale, qf[4 * c + 1] * scale);
    q.b[c][1] = common::pack2<half>(qf[4 * c + 2] * scale, qf[4 * c + 3] * scale);
  }
}

// One 64-token tile for warp `warp`: its rows 16 warp .. + 15. probs is the warp's P buffer.
template <typename T>
__device__ __forceinline__ void decode_tile_mma(const uint8_t* k_tile, const uint8_t* v_tile,
                                                const MmaQuery<T::kMmaChunks>& q, int valid_rows, float post_scale,
                                                half (&probs)[16][8], int warp, int lane,
                                                MmaState<T::kMmaChunks>& st) {
  using Vec = common::Vec16<typename T::DTypeKV>;
  using Swizzle = common::Swizzle128<T::kBdx>;
  constexpr int kCellsPerLane = T::kBdx / 4;  // 16-byte cells of a K row per lane
  const int g = lane / 4, t = lane % 4;
  const int row = 16 * warp + g;

  // S^T = K Q^T: s[0..1] = (token row, heads 2t, 2t + 1), s[2..3] = (token row + 8, same heads).
  float s[4] = {};
#pragma unroll
  for (int cell = 0; cell < kCellsPerLane; ++cell) {
    const int col = kCellsPerLane * t + cell;
    const uint4 k_top = *reinterpret_cast<const uint4*>(k_tile + 16 * Swizzle::cell(row, col));
    const uint4 k_bottom = *reinterpret_cast<const uint4*>(k_tile + 16 * Swizzle::cell(row + 8, col));
    const uint32_t* top = reinterpret_cast<const uint32_t*>(&k_top);
    const uint32_t* bottom = reinterpret_cast<const uint32_t*>(&k_bottom);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t a[4] = {Vec::pair_to_half2_bits(top[w], 0), Vec::pair_to_half2_bits(bottom[w], 0),
                             Vec::pair_to_half2_bits(top[w], 1), Vec::pair_to_half2_bits(bottom[w], 1)};
      common::mma_m16n8k16<half>(s, a, q.b[4 * cell + w][0], q.b[4 * cell + w][1]);
    }
  }

  // Online softmax per head over the warp's 16 tokens (a head's 4 values per lane group of one t).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float score = s[i] * q.unscale;
    if constexpr (T::kSoftCap) score = post_scale * common::fast_tanh(score);
    s[i] = row + 8 * (i / 2) < valid_rows ? score : common::kNegInf;
  }
  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float tile_max = common::lane_group_max<8, 4>(fmaxf(s[h], s[h + 2]));
    const float m_new = fmaxf(st.m[h], tile_max);
    const float m_safe = m_new == common::kNegInf ? 0.f : m_new;  // nothing valid yet: p is 0 anyway
    alpha[h] = m_new > st.m[h] ? common::fast_exp2(st.m[h] - m_safe) : 1.f;
    st.m[h] = m_new;
    s[h] = common::fast_exp2(s[h] - m_safe);
    s[h + 2] = common::fast_exp2(s[h + 2] - m_safe);
    st.d[h] = st.d[h] * alpha[h] + s[h] + s[h + 2];
  }
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int ch = 0; ch < T::kMmaChunks; ++ch) {
#pragma unroll
      for (int i = 0; i < 4; ++i) st.o[ch][i] *= alpha[i % 2];
    }
  }

  // P^T as B: P (fp16, at most 1) stored [token][head], read back transposed.
  common::store_shared_u32(common::smem_addr(&probs[g][2 * t]), common::pack2<half>(s[0], s[1]));
  common::store_shared_u32(common::smem_addr(&probs[g + 8][2 * t]), common::pack2<half>(s[2], s[3]));
  __syncwarp();
  uint32_t p_frag[2];
  common::ldmatrix_x2_trans(p_frag, &probs[lane % 16][0]);

  // O^T += V^T P^T, two 16-dim chunks per ldmatrix: matrix m holds tokens 8 (m % 2) .. + 7 of cell
  // 2 pair + m / 2; a lane's word of it is (tokens 2t, 2t + 1) x (dims 2g, 2g + 1), which one
  // byte permute splits into dim 2g's and dim 2g + 1's token pairs.
#pragma unroll
  for (int pair = 0; pair < T::kMmaChunks / 2; ++pair) {
    const int matrix = lane / 8;
    uint32_t v[4];
    common::ldmatrix_x4_trans(
        v, v_tile + 16 * Swizzle::cell(16 * warp + 8 * (matrix % 2) + lane % 8, 2 * pair + matrix / 2));
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const uint32_t top = __byte_perm(v[2 * part], 0u, 0x3120u);         // tokens 2t, 2t + 1
      const uint32_t bottom = __byte_perm(v[2 * part + 1], 0u, 0x3120u);  // tokens 2t + 8, 2t + 9
      const uint32_t a[4] = {Vec::pair_to_half2_bits(top, 0), Vec::pair_to_half2_bits(top, 1),
                             Vec::pair_to_half2_bits(bottom, 0), Vec::pair_to_half2_bits(bottom, 1)};
      common::mma_m16n8k16<half>(st.o[2 * pair + part], a, p_frag[0], p_frag[1]);
    }
  }
}

// The warp's state after the kv loop into the kernel's token-lane slot `warp` (LaneStates), in
// natural dim order, for the CTA's real heads.
template <typename T, typename LaneStates>
__device__ __forceinline__ void share_mma_state(MmaState<T::kMmaChunks>& st, LaneStates& lanes, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st.d[h] = common::lane_group_sum<8, 4>(st.d[h]);
    const int head = 2 * t + h;
    if (head >= T::kHeadsPerCta) continue;
#pragma unroll
    for (int ch = 0; ch < T::kMmaChunks; ++ch) {
      lanes.o[warp][head][16 * ch + 2 * g] = st.o[ch][h];
      lanes.o[warp][head][16 * ch + 2 * g + 1] = st.o[ch][2 + h];
    }
    if (g == 0) {
      lanes.m[warp][head] = st.m[h];
      lanes.d[warp][head] = st.d[h];
    }
  }
}

}  // namespace attnforge::fa2
