// Role: the FA2 prefill kernel's tensor-core math: shared -> register fragment loads (ldmatrix;
//   fp8 widened to fp16), S = Q K^T (compute_scores) and O += P V (accumulate_pv) on mma.sync
//   m16n8k16 with fp32 accumulation, and the once-per-CTA rewrite of the Q tile for an fp8 cache
//   (prepare_q_for_fp8_kv).
//
// Contract:
//   - A 16-bit cache runs the MMAs in q's type, every fragment in its natural order.
//   - An fp8 cache (e4m3/e5m2, with a 16-bit q) stays fp8 in shared memory; each warp widens the
//     fragments it loads to fp16, exactly, and runs fp16 MMAs. q is put in fp16 once per CTA (a bf16
//     one times a power of two, undone in the score scale) with the dims of every 16-dim chunk in
//     the order the fp8 K fragments arrive in; a dot product does not depend on the order of its
//     dims. o's columns then come out in the order V's do (o_col).
//   - With RoPE over an fp8 cache, Q.K reads K's rotated fp16 tile (T::kRotatedK16,
//     prefill_loads.cuh's rope_k_tile) in natural order, and q keeps its natural order too; V is
//     read as above.
//   - compute_scores returns raw fp32 dot products; accumulate_pv takes base-2 probabilities in the
//     score fragment and o's per-row rescale factors (softmax_update's alpha), and (T::kRowSumMma)
//     adds each row's probabilities to d (the whole row's sum in every lane of its quad).
//
// Must not: scale, mask or exponentiate scores (o's rescale is the only scaling here), or touch
// global memory.
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "../common/mma.cuh"
#include "../common/swizzle.cuh"
#include "../common/vec.cuh"

#include "prefill_traits.cuh"
#include "prefill_state.cuh"

namespace attnforge::fa2 {

// A lane's ldmatrix rows in a Swizzle128 tile, as byte offsets from the tile. Fragment loads read
// 32-byte column pairs j (cells 2 j and 2 j + 1, the lane's cell c0 of them) of rows row0 + 16 i, all
// with row0 % 8. Rows are whole 128-byte lines, so under the swizzle (XOR of a cell's low 3 bits
// with row % 8) pair j of row row0 lies at (off0 ^ 32 (j % 4)) + 128 (j / 4) with off0 the byte
// offset of (row0, c0 ^ row0 % 8): one XOR with a constant per j % 4, and immediate offsets for the
// line j / 4 and the row block i.
template <int kCells>
struct LaneRows {
  uint32_t off0;
  __device__ __forceinline__ LaneRows(int row, int c0) : off0(16u * (row * kCells + (c0 ^ (row & 7)))) {}
  // Pair (4 line + quarter) of row block i; quarter < 4.
  __device__ __forceinline__ uint32_t at(int i, int line, int quarter) const {
    return (off0 ^ (32u * quarter)) + 128u * line + 16u * 16u * kCells * i;
  }
};

// An fp8 word of four one-byte elements as two registers of fp16 pairs: bytes (0, 1) and (2, 3).
template <typename T>
__device__ __forceinline__ void widen_fp8_word(uint32_t word, uint32_t& lo, uint32_t& hi) {
  lo = common::Vec16<typename T::DTypeKV>::pair_to_half2_bits(word, 0);
  hi = common::Vec16<typename T::DTypeKV>::pair_to_half2_bits(word, 1);
}

// K's B fragments for one step of 16 keys (the row address from LaneRows kr): b[c][0..1] for keys
// 0-7 and b[c][2..3] for keys 8-15 of the step's 16-dim chunk c. 16-bit: one ldmatrix_x4, natural
// order. fp8: matrices (keys 0-7, dims 0-15), (keys 0-7, 16-31), (keys 8-15, 0-15), (keys 8-15,
// 16-31); lane (g, t) gets dims 4t .. 4t + 3 of key g, which fill B's k slots 2t, 2t + 1 and
// 2t + 8, 2t + 9: the dim order prepare_q_for_fp8_kv gave q.
template <typename T>
__device__ __forceinline__ void load_k_fragments(uint32_t row, uint32_t (&b)[T::kChunksPerLoadQK][4]) {
  uint32_t r[4];
  common::ldmatrix_x4(r, row);
  if constexpr (T::kFp8KFragments) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int keys = 0; keys < 2; ++keys) widen_fp8_word<T>(r[2 * keys + c], b[c][2 * keys], b[c][2 * keys + 1]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) b[0][i] = r[i];
  }
}

// V's B fragments (transposed) for one step of 16 keys (LaneRows vr): b[c][0..1] for the first
// n8 block of o's chunk c, b[c][2..3] for the second. 16-bit: dims 0-7 and 8-15. fp8: ldmatrix.trans
// hands lane (g, t) the byte pairs (dims 2g, 2g + 1) of keys 2t and 2t + 1; regrouped by dim, they
// are the even dims 2g (first block) and the odd dims 2g + 1 (second), which o_col follows.
template <typename T>
__device__ __forceinline__ void load_v_fragments(uint32_t row, uint32_t (&b)[T::kChunksPerLoadVO][4]) {
  uint32_t r[4];
  common::ldmatrix_x4_trans(r, row);
  if constexpr (T::kFp8KV) {
    // matrices (keys 0-7, dims 0-15), (keys 8-15, 0-15), (keys 0-7, 16-31), (keys 8-15, 16-31)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int keys = 0; keys < 2; ++keys) {
        const uint32_t by_dim = __byte_perm(r[2 * c + keys], 0u, 0x3120u);  // (k0 d0, k1 d0, k0 d1, k1 d1)
        widen_fp8_word<T>(by_dim, b[c][keys], b[c][2 + keys]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) b[0][i] = r[i];
  }
}

// fp8 cache: rewrite the landed Q tile (16-bit, Swizzle128) for the fp16 MMAs. Each 16-dim chunk
// takes the order of load_k_fragments (stored dims 2t + j <- 4t + j, 2t + 8 + j <- 4t + 2 + j,
// t < 4, j < 2: 32-bit words 0, 2, 4, 6, 1, 3, 5, 7), or stays in order when K is rotated into
// fp16 (kRotatedK16); a bf16 q is multiplied by the power of two
// that brings the CTA's largest |q| into [2^13, 2^14) (fp16 then keeps bf16's 8 significant bits
// down to 2^-24 of it). Returns what multiplies a score to undo it. Every Q copy must be visible
// (a barrier after the wait); the caller's next barrier publishes the result.
template <typename T>
__device__ __forceinline__ float prepare_q_for_fp8_kv(typename T::Tiles& tiles) {
  using Vec = common::Vec16<typename T::DTypeQ>;
  using Swizzle = common::Swizzle128<T::kRowCellsQ>;
  const uint4* cells = reinterpret_cast<const uint4*>(tiles.q);
  int shift = 0;
  if constexpr (std::is_same_v<typename T::DTypeQ, __nv_bfloat16>) {
    float abs_max = 0.f;
    for (int idx = threadIdx.x; idx < T::kCtaTileQ * T::kCellsQK; idx += T::kThreads) {
      float f[8];
      Vec::to_float(cells[Swizzle::cell(idx / T::kCellsQK, idx % T::kCellsQK)], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) abs_max = fmaxf(abs_max, fabsf(f[i]));
    }
    // Non-negative floats order as their bits.
    const unsigned warp_max = __reduce_max_sync(0xffffffffu, __float_as_uint(abs_max));
    if (threadIdx.x % 32 == 0) atomicMax(&tiles.q_abs_max[0], warp_max);
    __syncthreads();
    const float cta_max = __uint_as_float(tiles.q_abs_max[0]);
    int exponent;
    frexpf(cta_max, &exponent);  // cta_max in [2^(exponent - 1), 2^exponent)
    if (cta_max > 0.f && cta_max <= FLT_MAX) shift = max(-126, min(126, 14 - exponent));
  }
  const float scale = __int_as_float((127 + shift) << 23);
  constexpr int kChunks = T::kHeadDimQK / 16;
  for (int idx = threadIdx.x; idx < T::kCtaTileQ * kChunks; idx += T::kThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    uint4* lo = reinterpret_cast<uint4*>(tiles.q) + Swizzle::cell(row, 2 * chunk);
    uint4* hi = reinterpret_cast<uint4*>(tiles.q) + Swizzle::cell(row, 2 * chunk + 1);
    float f[16];
    Vec::to_float(*lo, *reinterpret_cast<float(*)[8]>(f));
    Vec::to_float(*hi, *reinterpret_cast<float(*)[8]>(f + 8));
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = common::pack2<half>(f[2 * i] * scale, f[2 * i + 1] * scale);
    if constexpr (T::kFp8KFragments) {
      *lo = make_uint4(w[0], w[2], w[4], w[6]);
      *hi = make_uint4(w[1], w[3], w[5], w[7]);
    } else {
      *lo = make_uint4(w[0], w[1], w[2], w[3]);
      *hi = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
  return __int_as_float((127 - shift) << 23);
}

// s = Q . K^T for this warp's rows and kv columns (raw dot products, fp32).
// K steps run as j = 4 line + quarter, quarter-major (a dot product does not depend on the order):
// each quarter's addresses are one XOR per operand, the lines and row blocks immediates. Unrolled
// over quarters as T::kUnrollQuartersQK says: fully, the first MMAs add to constant zeros and ptxas
// overlaps a step's ldmatrix with the MMAs before it. (With the addresses as row * cells +
// (cell ^ x) per step, full unrolling hoisted every step's address and ran out of registers;
// unrolled by two over quarters it spills more.)
template <typename T>
__device__ __forceinline__ void compute_scores(const typename T::DTypeMma* q, const typename T::DTypeKScores* k,
                                               int warp_q, int warp_kv, float (&s)[T::kMmaQ][T::kMmaKV][8]) {
  constexpr int kChunks = T::kChunksPerLoadQK;
  constexpr int kSteps = T::kMmaDQK / kChunks;  // K loads of 16 keys x 32 bytes
  constexpr int kLines = (kSteps + 3) / 4;
  const int lane = threadIdx.x % 32;
  const uint32_t q_base = common::smem_addr(q), k_base = common::smem_addr(k);
  // Q: matrices (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15).
  const LaneRows<T::kRowCellsQ> qr(warp_q * T::kMmaQ * 16 + lane % 16, lane / 16);
  // K: matrices (kv 0-7, cell 0), (kv 0-7, cell 1), (kv 8-15, cell 0), (kv 8-15, cell 1).
  const LaneRows<T::kRowCellsKScores> kr(warp_kv * T::kMmaKV * 16 + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
#pragma unroll
  for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
    for (int mk = 0; mk < T::kMmaKV; ++mk) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s[mq][mk][e] = 0.f;
    }
  }
#pragma unroll(T::kUnrollQuartersQK)
  for (int quarter = 0; quarter < 4; ++quarter) {
#pragma unroll
    for (int line = 0; line < kLines; ++line) {
      if (line >= kSteps / 4 && 4 * line + quarter >= kSteps) continue;
      uint32_t a[T::kMmaQ][kChunks][4];
#pragma unroll
      for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int pair = kChunks * quarter + c;  // Q's pair is kChunks * 4 line + pair
          common::ldmatrix_x4(a[mq][c], q_base + qr.at(mq, kChunks * line + pair / 4, pair % 4));
        }
      }
#pragma unroll
      for (int mk = 0; mk < T::kMmaKV; ++mk) {
        uint32_t b[kChunks][4];
        load_k_fragments<T>(k_base + kr.at(mk, line, quarter), b);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
#pragma unroll
          for (int mq = 0; mq < T::kMmaQ; ++mq) {
            common::mma_m16n8k16<typename T::DTypeMma>(*reinterpret_cast<float(*)[4]>(&s[mq][mk][0]), a[mq][c], b[c][0], b[c][1]);
            common::mma_m16n8k16<typename T::DTypeMma>(*reinterpret_cast<float(*)[4]>(&s[mq][mk][4]), a[mq][c], b[c][2], b[c][3]);
          }
        }
      }
    }
  }
}

// o = alpha o + P . V for this warp's rows (alpha: softmax_update's rescale of each row, applied to
// an o chunk right before its first MMA). P arrives as base-2 probabilities in the score fragment;
// C fragment pairs (e, e + 1) are exactly the A fragment registers of the P.V mma.
template <typename T>
__device__ __forceinline__ void accumulate_pv(const typename T::DTypeKV* v, int warp_kv,
                                              const float (&s)[T::kMmaQ][T::kMmaKV][8], const float (&alpha)[T::kMmaQ][2],
                                              PrefillState<T>& st) {
  using DType = typename T::DTypeMma;
  constexpr int kChunks = T::kChunksPerLoadVO;
  const int lane = threadIdx.x % 32;
  const uint32_t v_base = common::smem_addr(v);
  // V, transposed: matrices (kv 0-7, cell 0), (kv 8-15, cell 0), (kv 0-7, cell 1), (kv 8-15, cell 1).
  const LaneRows<T::kRowCellsVO> vr(warp_kv * T::kMmaKV * 16 + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
#pragma unroll
  for (int mk = 0; mk < T::kMmaKV; ++mk) {
    uint32_t a[T::kMmaQ][4];
#pragma unroll
    for (int mq = 0; mq < T::kMmaQ; ++mq) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[mq][r] = common::pack2<DType>(s[mq][mk][2 * r], s[mq][mk][2 * r + 1]);
      // d += P's row sums as P times a column of ones on the tensor pipe: one MMA for the 16 keys,
      // where summing in fp32 took 16 adds a lane (and a quad reduction); it sums the rounded P
      // that P.V weighs V with.
      if constexpr (T::kRowSumMma) {
        float sums[4] = {st.d[mq][0], st.d[mq][0], st.d[mq][1], st.d[mq][1]};
        common::mma_m16n8k16<DType>(sums, a[mq], common::kOnes2<DType>, common::kOnes2<DType>);
        st.d[mq][0] = sums[0];
        st.d[mq][1] = sums[2];
      }
    }
#pragma unroll
    for (int step = 0; step < T::kMmaDVO / kChunks; ++step) {
      uint32_t b[kChunks][4];
      load_v_fragments<T>(v_base + vr.at(mk, step / 4, step % 4), b);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int mq = 0; mq < T::kMmaQ; ++mq) {
          float(&o_mq)[8] = st.o[mq][step * kChunks + c];
          if (mk == 0) {
#pragma unroll
            for (int e = 0; e < 8; ++e) o_mq[e] *= alpha[mq][frag_row_half(e)];
          }
          common::mma_m16n8k16<DType>(*reinterpret_cast<float(*)[4]>(&o_mq[0]), a[mq], b[c][0], b[c][1]);
          common::mma_m16n8k16<DType>(*reinterpret_cast<float(*)[4]>(&o_mq[4]), a[mq], b[c][2], b[c][3]);
        }
      }
    }
  }
}

}  // namespace attnforge::fa2
