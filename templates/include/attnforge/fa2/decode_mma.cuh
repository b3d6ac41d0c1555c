// Role: the FA2 decode kernel's tensor-core tile (DecodeTraits::kMmaTile): rows of whole 128-byte
//   lines (16-bit hd 64 to 224, fp8 hd 128 and 256) read for 4 to 8 query heads, where the
//   CUDA-core tile (decode_simt.cuh) is issue-bound: it multiplies each K/V element once per head,
//   and converts an fp8 one once per head group. Here a warp takes 16 rows of a 64-token tile as
//   its own token lane (its own online softmax, merged after the kv loop like the CUDA-core tile's
//   token lanes) and runs mma.sync m16n8k16 with fp32 accumulation (fp16 for an fp8 cache, else
//   the cache's type), the CTA's heads as the MMAs' N (8; rows past the CTA's heads are zero
//   queries, never stored). Rows of 512 bytes (16-bit hd 160 to 224 in 256 columns) come in
//   32-token tiles, a warp pair per 16 rows (kMmaSplit): each warp of a pair takes half of the
//   real 16-dim chunks (kMmaWarpChunks) of the products below, the pair adds its partial S^T
//   through shared memory, and both run the same softmax on the same sums:
//     S^T (16 tokens x 8 heads) = K (16 x hd, A from the ring) . Q^T (hd x 8, B in registers);
//     O^T (hd x 8)             += V^T (hd x 16, A from the ring) . P^T (16 x 8, B through shared memory).
//   Every fp8 element is converted to fp16 (exactly, one cvt per pair) once per CTA. P goes in as
//   two terms of the MMA type, its rounding and the rest, so P.V keeps the CUDA-core tile's fp32
//   accuracy (bf16 P alone moved o by more than an ulp between split and unsplit runs).
//
// Contract (fragment layouts of common/mma.cuh; lane = (g, t) = (lane / 4, lane % 4)):
//   - the ring holds rows of whole 128-byte lines placed by common::Swizzle128 (ring_element); a
//     16-bit row may be padded (hd 80, 96, 112 in 128 columns): only its hd / 16 real chunks
//     (kMmaChunks) are read, of K, V and q, and written to the lane states; they start at ring
//     chunk ring_chunk (the slice's 32-byte offset in its first line, where the kernel copied the
//     whole lines around it), chunk 0 of q and o;
//   - 16-bit: K by ldmatrix and V^T by ldmatrix.trans, in natural order;
//   - fp8, K: lane (g, t) reads dims [hd/4 t, hd/4 (t + 1)) of rows g and g + 8, so k index 2t + {0, 1}
//     (+8) of k-step c is dim hd/4 t + 4c + {0, 1} ({2, 3}); q's B fragments follow the same order
//     (a dot product does not depend on the order of its dims);
//   - fp8, V: ldmatrix.trans hands out byte pairs (dims 2r, 2r + 1) of two tokens, so row r of dim
//     chunk ch's A is dim 16 ch + 2r and row r + 8 is dim 16 ch + 2r + 1 (mma_dim undoes it);
//   - a warp pair's warps are 2 b and 2 b + 1 (row block b), warp 2 b + h holding chunks
//     [h kMmaWarpChunks, (h + 1) kMmaWarpChunks); it meets at named barrier 1 + b;
//   - it comes before decode_traits.cuh in the translation unit and reads DecodeTraits only
//     through its template parameter T.
//
// Must not: plan, copy or store results; the kernel owns the ring, the lane merge and the stores.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/barrier.cuh"
#include "../common/math.cuh"
#include "../common/mma.cuh"
#include "../common/swizzle.cuh"
#include "../common/vec.cuh"

namespace attnforge::fa2 {

// q's B fragments for head g, k-step c: 16-bit, b[c][0] holds dims 16c + 2t, + 1 and b[c][1] dims
// 16c + 2t + 8, + 9 (natural order), as q is; fp8, b[c][0] holds dims 4c, 4c + 1 and b[c][1] dims
// 4c + 2, 4c + 3 of this lane's hd / 4 (the K order), all of q in fp16 times one power of two that
// puts its max |q| at most kMmaQueryBound (a bf16 q is then exact in fp16, and the products sum in
// fp32). unscale turns a sum into a base-2 logit.
template <int kKSteps>
struct MmaQuery {
  uint32_t b[kKSteps][2];
  float unscale;
};

constexpr float kMmaQueryBound = 0x1p14f;

// The MMAs' 16-bit type: fp16 for an fp8 cache (which it holds exactly), else the cache's.
template <typename T>
using MmaType = std::conditional_t<sizeof(typename T::DTypeKV) == 1, half, typename T::DTypeKV>;

// The dim that row `row` (0-15) of O^T's 16-dim chunk `chunk` holds.
template <typename T>
__device__ __forceinline__ int mma_dim(int chunk, int row) {
  if constexpr (sizeof(typename T::DTypeKV) == 1) return 16 * chunk + 2 * (row % 8) + row / 8;
  return 16 * chunk + row;
}

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
                                               int warp, int lane, MmaQuery<T::kMmaWarpChunks>& q) {
  constexpr int kDims = T::kHeadDim / 4;
  const int g = lane / 4, t = lane % 4;
  const typename T::DTypeQ* q_row = nullptr;
  if (g < T::kHeadsPerCta) {
    const int qo_head = kv_head * p.group_size + min(first_slot + g, p.group_size - 1);
    q_row = static_cast<const typename T::DTypeQ*>(p.q) + request * p.q_stride_n + qo_head * p.q_stride_h;
  }
  if constexpr (sizeof(typename T::DTypeKV) == 2) {  // q has the cache's type: its pairs as they are
    q.unscale = p.score_scale;
    const int first = (warp % T::kMmaSplit) * T::kMmaWarpChunks;  // this warp's chunks (of a pair)
#pragma unroll
    for (int c = 0; c < T::kMmaWarpChunks; ++c) {
      q.b[c][0] = q_row ? *reinterpret_cast<const uint32_t*>(q_row + 16 * (first + c) + 2 * t) : 0u;
      q.b[c][1] = q_row ? *reinterpret_cast<const uint32_t*>(q_row + 16 * (first + c) + 2 * t + 8) : 0u;
    }
  } else {  // an fp8 row is never padded (kMmaTile): hd / 4 is whole 16-byte vectors of q
    float qf[kDims] = {};
    if (q_row) common::load_float(q_row + kDims * t, qf);
    float max_abs = 0.f;
#pragma unroll
    for (int e = 0; e < kDims; ++e) max_abs = fmaxf(max_abs, fabsf(qf[e]));
    const float scale = common::pow2_scale_within(kMmaQueryBound, common::lane_group_max<32>(max_abs));
    q.unscale = p.score_scale / scale;
#pragma unroll
    for (int c = 0; c < T::kMmaWarpChunks; ++c) {
      q.b[c][0] = common::pack2<half>(qf[4 * c] * scale, qf[4 * c + 1] * scale);
      q.b[c][1] = common::pack2<half>(qf[4 * c + 2] * scale, qf[4 * c + 3] * scale);
    }
  }
}

// S^T = K Q^T for row block `block`'s 16 rows over the warp's chunks from ring chunk `first`: s[0..1] =
// (token row g, heads 2t, 2t + 1), s[2..3] = (token row g + 8, same heads).
template <typename T>
__device__ __forceinline__ void scores_mma(const uint8_t* k_tile, const MmaQuery<T::kMmaWarpChunks>& q, int block,
                                           int first, int lane, float (&s)[4]) {
  using Swizzle = common::Swizzle128<T::kBdx>;
  const int matrix = lane / 8;  // ldmatrix: the matrix this lane gives a row address of
  if constexpr (sizeof(typename T::DTypeKV) == 2) {
#pragma unroll
    for (int c = 0; c < T::kMmaWarpChunks; ++c) {  // matrices (rows 0-7 | 8-15) x (dims 16c.. | 16c + 8..)
      uint32_t a[4];
      common::ldmatrix_x4(
          a, k_tile + 16 * Swizzle::cell(16 * block + 8 * (matrix % 2) + lane % 8, 2 * (first + c) + matrix / 2));
      common::mma_m16n8k16<MmaType<T>>(s, a, q.b[c][0], q.b[c][1]);
    }
  } else {
    using Vec = common::Vec16<typename T::DTypeKV>;
    constexpr int kCellsPerLane = T::kBdx / 4;  // 16-byte cells of a K row per lane
    const int row = 16 * block + lane / 4, t = lane % 4;
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
  }
}

// O^T += V^T P^T for row block `block`'s 16 rows and the warp's chunks from ring chunk `first` (p_frag: P^T's
// B fragments, its two terms).
template <typename T>
__device__ __forceinline__ void accumulate_pv_mma(const uint8_t* v_tile, const uint32_t (&p_frag)[4], int block,
                                                  int first, int lane, float (&o)[T::kMmaWarpChunks][4]) {
  using Swizzle = common::Swizzle128<T::kBdx>;
  const int matrix = lane / 8;
  if constexpr (sizeof(typename T::DTypeKV) == 2) {
    // ldmatrix.trans of (tokens 0-7 | 8-15) x (dims 16ch.. | 16ch + 8..) is A as it is.
#pragma unroll
    for (int ch = 0; ch < T::kMmaWarpChunks; ++ch) {
      uint32_t a[4];
      common::ldmatrix_x4_trans(
          a, v_tile + 16 * Swizzle::cell(16 * block + 8 * (matrix / 2) + lane % 8, 2 * (first + ch) + matrix % 2));
      common::mma_m16n8k16<MmaType<T>>(o[ch], a, p_frag[0], p_frag[1]);
      common::mma_m16n8k16<MmaType<T>>(o[ch], a, p_frag[2], p_frag[3]);
    }
  } else {
    // Two 16-dim chunks per ldmatrix: matrix m holds tokens 8 (m % 2) .. + 7 of cell 2 pair + m / 2;
    // a lane's word of it is (tokens 2t, 2t + 1) x (dims 2g, 2g + 1), which one byte permute splits
    // into dim 2g's and dim 2g + 1's token pairs.
    using Vec = common::Vec16<typename T::DTypeKV>;
#pragma unroll
    for (int pair = 0; pair < T::kMmaWarpChunks / 2; ++pair) {
      uint32_t v[4];
      common::ldmatrix_x4_trans(
          v, v_tile + 16 * Swizzle::cell(16 * block + 8 * (matrix % 2) + lane % 8, 2 * pair + matrix / 2));
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        const uint32_t top = __byte_perm(v[2 * part], 0u, 0x3120u);         // tokens 2t, 2t + 1
        const uint32_t bottom = __byte_perm(v[2 * part + 1], 0u, 0x3120u);  // tokens 2t + 8, 2t + 9
        const uint32_t a[4] = {Vec::pair_to_half2_bits(top, 0), Vec::pair_to_half2_bits(top, 1),
                               Vec::pair_to_half2_bits(bottom, 0), Vec::pair_to_half2_bits(bottom, 1)};
        common::mma_m16n8k16<half>(o[2 * pair + part], a, p_frag[0], p_frag[1]);
        common::mma_m16n8k16<half>(o[2 * pair + part], a, p_frag[2], p_frag[3]);
      }
    }
  }
}

// P's two terms as pairs of the MMA type: `rounded` = p in it, `rest` = what that rounding lost.
template <typename T>
__device__ __forceinline__ void split_probs(float p0, float p1, uint32_t& rounded, uint32_t& rest) {
  using Mma = MmaType<T>;
  const float r0 = float(Mma(p0)), r1 = float(Mma(p1));
  rounded = common::pack2<Mma>(r0, r1);  // exact
  rest = common::pack2<Mma>(p0 - r0, p1 - r1);
}

// One tile for warp `warp`: rows 16 b .. + 15 of its row block b = warp / kMmaSplit, the row's real
// chunks from ring chunk ring_chunk (0 unless the ring row holds whole lines). probs is the
// warp's P buffer: rows 0-15 P's rounded term, 16-31 its rest, [token][head]; partial_scores the
// warp pairs' S^T fragments (kMmaSplit 2), [warp][lane].
template <typename T>
__device__ __forceinline__ void decode_tile_mma(const uint8_t* k_tile, const uint8_t* v_tile,
                                                const MmaQuery<T::kMmaWarpChunks>& q, int valid_rows, float post_scale,
                                                uint32_t (&probs)[32][4], float4 (*partial_scores)[32],
                                                int ring_chunk, int warp, int lane, MmaState<T::kMmaWarpChunks>& st) {
  const int g = lane / 4, t = lane % 4;
  const int block = warp / T::kMmaSplit;
  const int first = (warp % T::kMmaSplit) * T::kMmaWarpChunks;
  const int row = 16 * block + g;
  float s[4] = {};
  scores_mma<T>(k_tile, q, block, ring_chunk + first, lane, s);
  if constexpr (T::kMmaSplit > 1) {
    // The pair's two halves of each dot product, added in the same order by both warps (a + b is
    // b + a), so both run the same softmax. The slot written here was read before the kv loop's
    // __syncthreads that precedes this tile.
    static_assert(T::kMmaSplit == 2 && T::kMmaRowBlocks == 2, "decode mma tile: two warp pairs, barriers 1 and 2");
    partial_scores[warp][lane] = make_float4(s[0], s[1], s[2], s[3]);
    if (block == 0) {
      common::named_barrier_sync<1, 64>();
    } else {
      common::named_barrier_sync<2, 64>();
    }
    const float4 other = partial_scores[warp ^ 1][lane];
    s[0] += other.x;
    s[1] += other.y;
    s[2] += other.z;
    s[3] += other.w;
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
    for (int ch = 0; ch < T::kMmaWarpChunks; ++ch) {
#pragma unroll
      for (int i = 0; i < 4; ++i) st.o[ch][i] *= alpha[i % 2];
    }
  }

  // P^T as B: P's terms stored [token][head], read back transposed (matrices: rounded tokens 0-7,
  // 8-15, rest tokens 0-7, 8-15).
  uint32_t rounded, rest;
  split_probs<T>(s[0], s[1], rounded, rest);
  common::store_shared_u32(common::smem_addr(&probs[g][t]), rounded);
  common::store_shared_u32(common::smem_addr(&probs[16 + g][t]), rest);
  split_probs<T>(s[2], s[3], rounded, rest);
  common::store_shared_u32(common::smem_addr(&probs[g + 8][t]), rounded);
  common::store_shared_u32(common::smem_addr(&probs[16 + g + 8][t]), rest);
  __syncwarp();
  uint32_t p_frag[4];
  common::ldmatrix_x4_trans(p_frag, &probs[lane][0]);
  accumulate_pv_mma<T>(v_tile, p_frag, block, ring_chunk + first, lane, st.o);
}

// The warp's state after the kv loop into its row block's token-lane slot (LaneStates), in natural
// dim order, for the CTA's real heads; of a pair, each warp its chunks and the first (m, d).
template <typename T, typename LaneStates>
__device__ __forceinline__ void share_mma_state(MmaState<T::kMmaWarpChunks>& st, LaneStates& lanes, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int block = warp / T::kMmaSplit, part = warp % T::kMmaSplit;
  const int first = part * T::kMmaWarpChunks;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st.d[h] = common::lane_group_sum<8, 4>(st.d[h]);
    const int head = 2 * t + h;
    if (head >= T::kHeadsPerCta) continue;
#pragma unroll
    for (int ch = 0; ch < T::kMmaWarpChunks; ++ch) {
      lanes.o[block][head][mma_dim<T>(first + ch, g)] = st.o[ch][h];
      lanes.o[block][head][mma_dim<T>(first + ch, g + 8)] = st.o[ch][2 + h];
    }
    if (g == 0 && part == 0) {
      lanes.m[block][head] = st.m[h];
      lanes.d[block][head] = st.d[h];
    }
  }
}

}  // namespace attnforge::fa2
