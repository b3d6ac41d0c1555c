// Role: fp8 V transposed into the K-major layout the fp8 P.V wgmma reads: from staged TMA rows
//   (ldmatrix and byte permutes, by the producer or, in decode items, by consumer warpgroup 1), on
//   the way from global memory for gathered tiles, and ahead of the prefill kernel by
//   transpose_v_kernel into the workspace.
// Contract: Vt(d, slot) = V(p_key_of_slot(slot), d): within each 32 keys V's rows come in the order
//   P's registers hold the keys, so P needs no shuffle. Transposed ahead: block b of kv head h
//   holds request r's keys kBlockN (b - vt_block[r]) on, zeros past the request's end; every q tile
//   of a request then reads its V^T by one TMA box, where each would otherwise transpose V again
//   (the ragged hd 128 kernel runs 7-8% faster without the transposes, paged 16-20%).
// Must not: be used by 16-bit kernels (their V is read MN-major as it lies).
#pragma once

#include "kv_tiles.cuh"

namespace attnforge::fa3 {

// Byte selectors of the first transpose step: interleave two keys' dims 0-1 (or 2-3), each also
// with the two keys swapped.
constexpr uint32_t kPairsLow = 0x5140, kPairsHigh = 0x7362;                // k0d0 k1d0 k0d1 k1d1 | d2 d3
constexpr uint32_t kPairsLowSwapped = 0x1504, kPairsHighSwapped = 0x3726;  // k1d0 k0d0 k1d1 k0d1 | d2 d3

// Bytes (key i, dim c) of four keys' words -> word c holds dim c of keys 0..3, in key order. The
// selectors may swap keys 0 <-> 1 and 2 <-> 3 (the swapped pairs) and dims 0-1 <-> 2-3 (the pairs'
// roles exchanged: words 0, 1 then hold dims 2, 3).
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&key_words)[4], uint32_t (&dim_words)[4],
                                                    uint32_t first_pairs = kPairsLow,
                                                    uint32_t second_pairs = kPairsHigh) {
  const uint32_t first01 = __byte_perm(key_words[0], key_words[1], first_pairs);
  const uint32_t first23 = __byte_perm(key_words[2], key_words[3], first_pairs);
  const uint32_t second01 = __byte_perm(key_words[0], key_words[1], second_pairs);
  const uint32_t second23 = __byte_perm(key_words[2], key_words[3], second_pairs);
  dim_words[0] = __byte_perm(first01, first23, 0x5410);
  dim_words[1] = __byte_perm(first01, first23, 0x7632);
  dim_words[2] = __byte_perm(second01, second23, 0x5410);
  dim_words[3] = __byte_perm(second01, second23, 0x7632);
}

// FP8 V tile from its staged rows: Vt(d, slot) = V(p_key_of_slot(slot), d). A slot word (4 slots)
// holds keys x, x + 1, x + 8, x + 9 (x = 16 (w / 4) + 2 (w % 4) for word w of a 32-key group).
// Warp g moves key group g, one ldmatrix.x4 per 16-byte dim chunk: matrix m's row j is key
// x_j + {0, 1, 8, 9}[m], except that rows 4-7 take m's partner (m ^ 1), so each matrix's 8 rows sit
// in distinct swizzle chunks. Lane t then holds dims 4 (t % 4) .. + 3 of the 4 keys of word t / 4,
// transposes them with byte permutes (whose selectors also undo the partner swap) and stores one
// word per dim; lanes with t % 4 >= 2 store their dims in an order shifted by 2, which puts each
// store's 32 words in distinct banks. Addresses: moving a chunk moves the source's swizzled
// 16-byte column (an XOR within the 128-byte row, then a 128-dim block) and the destination by 16
// rows (whose swizzle is the same: it depends on the row mod 8). Only the real dims move: a padded
// tile's last rows stay unwritten (traits.cuh: they reach only o's unstored columns).
template <typename T>
__device__ __forceinline__ void transpose_v_tile(typename T::SharedStorage& smem, int buffer, int stage, int tid) {
  using Element = typename T::Element;
  constexpr int kChunks = T::kHeadDimVO / 16, kLineChunks = 8, kBlockBytes = T::kBlockN * 128;
  static_assert(T::kBlockN == 32 * (T::kProducerThreads / 32), "fa3 fp8 V transpose: warp g moves key group g");
  const int lane = tid % 32, group = tid / 32;
  const int row = lane % 8, partner = (lane / 8) ^ (row / 4);
  const int row_key = 32 * group + 16 * (row / 4) + 2 * (row % 4) + (partner & 1) + 8 * (partner >> 1);
  const int word = lane / 4, dim0 = 4 * (lane % 4);
  const bool partnered = word >= 4, shifted = lane % 4 >= 2;
  const uint32_t pair_lo = partnered ? kPairsLowSwapped : kPairsLow;
  const uint32_t pair_hi = partnered ? kPairsHighSwapped : kPairsHigh;
  const uint32_t first_pairs = shifted ? pair_hi : pair_lo, second_pairs = shifted ? pair_lo : pair_hi;
  const uint32_t src = common::smem_addr(smem.v_rows) +
                       swizzled_offset<typename T::SmemLayoutVRows, Element>(row_key, 0, buffer);
  uint32_t dst[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[i] = common::smem_addr(smem.v) + swizzled_offset<typename T::SmemLayoutVt, Element>(
                                             dim0 + (shifted ? (i + 2) % 4 : i), 32 * group + 4 * word, stage);
  }
  // ldmatrix and the stores are volatile asm, kept in source order: chunk c + 1's ldmatrix goes
  // out before chunk c's stores (ptxas puts it after the chunk's permutes), so its latency
  // overlaps them.
  auto load_chunk = [&](uint32_t (&keys)[4], int chunk) {
    common::ldmatrix_x4(keys, (src ^ (chunk % kLineChunks * 16)) + chunk / kLineChunks * kBlockBytes);
  };
  uint32_t keys[2][4];
  load_chunk(keys[0], 0);
#pragma unroll
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    if (chunk + 1 < kChunks) load_chunk(keys[(chunk + 1) % 2], chunk + 1);
    uint32_t words[4];
    transpose_4x4_bytes(keys[chunk % 2], words, first_pairs, second_pairs);
#pragma unroll
    for (int i = 0; i < 4; ++i) common::store_shared_u32(dst[i] + chunk * 16 * T::kBlockN, words[i]);
  }
}

// FP8 V tile gathered and transposed: Vt(d, slot) = V(p_key_of_slot(slot), d), K-major for the PV wgmma.
// A thread reads 4 bytes (4 dims) of each of the 4 keys of 4 consecutive slots and writes them
// as 4 words of 4 slots, one per dim (a 4 x 4 byte transpose in registers). Consecutive threads
// take consecutive dims, so a warp reads 128 contiguous bytes of each key. Keys past the range
// read as zeros (row offset -1), as in the gather; a padded tile's dims past the real ones are not
// written, as in transpose_v_tile.
template <typename T, typename RowOffset>
__device__ __forceinline__ void load_v_tile_transposed(uint8_t* smem_base, const typename T::DTypeKV* head_base, int tid,
                                                       RowOffset row_offset, int stage) {
  constexpr int kDimGroups = T::kHeadDimVO / 4, kBlocks = kDimGroups * T::kBlockN / 4;
  static_assert(kBlocks % T::kProducerThreads == 0, "fa3 fp8 V transpose: every producer thread moves alike");
  const uint32_t vt = common::smem_addr(smem_base);
  // Not unrolled: the producer has 40 registers.
#pragma unroll 1
  for (int b = tid; b < kBlocks; b += T::kProducerThreads) {
    const int dim = b % kDimGroups * 4, slot = b / kDimGroups * 4;
    uint32_t key_words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t off = row_offset(p_key_of_slot(slot + i));
      key_words[i] = off >= 0 ? __ldg(reinterpret_cast<const uint32_t*>(head_base + off + dim)) : 0u;
    }
    uint32_t dim_words[4];
    transpose_4x4_bytes(key_words, dim_words);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      common::store_shared_u32(
          vt + swizzled_offset<typename T::SmemLayoutVt, typename T::Element>(dim + c, slot, stage), dim_words[c]);
    }
  }
}

// The whole warpgroup's plain stores into a stage are done: made visible to the wgmma (async
// proxy), the warpgroup met on its named barrier, then its thread 0 arrives on `full` for all.
template <typename T>
__device__ __forceinline__ void arrive_stored(uint64_t* full, int barrier, int tid) {
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
  if (tid == 0) arrive_for_all<kFullArrivals<T>>(full);
}

// A boxed fp8 tile's V rows, once they and the stage are ready, transposed from their staging
// buffer (number `staged` of the CTA) into the stage; then v_full and, in decode items, the
// buffer's release. By the producer warpgroup, or in decode items by consumer warpgroup 1
// (`barrier`: the transposing warpgroup's own named barrier; `tid` its thread).
template <typename T>
__device__ __forceinline__ void transpose_staged_v(typename T::SharedStorage& smem, int staged, int stage,
                                                   uint32_t free_phase, int tid, int barrier) {
  const int buffer = staged % T::kVStaging;
  cutlass::arch::ClusterTransactionBarrier::wait(&smem.v_rows_full[buffer], (staged / T::kVStaging) & 1);
  cutlass::arch::ClusterBarrier::wait(&smem.v_empty[stage], free_phase);
  transpose_v_tile<T>(smem, buffer, stage, tid);
  arrive_stored<T>(&smem.v_full[stage], barrier, tid);
  if (T::kDecodeItems && tid == 0) cutlass::arch::ClusterBarrier::arrive(&smem.v_rows_empty[buffer]);
}

// V transposed ahead: the workspace's blocks, [kv head][block][dim][kBlockN keys].
template <typename T>
cudaError_t encode_vt_map(KernelArgs<T>& args) {
  static_assert(T::kBlockN * T::kElementBytes == host::kTmaBoxBytes, "fa3 V transposed ahead: a block's keys fill one line");
  return host::encode_blocks_map(&args.vt_blocks, args.p.v_transposed, T::kHeadDimVO, T::kBlockN, args.p.vt_blocks,
                                 args.p.num_kv_heads);
}

template <typename T>
struct TransposeVStorage {
  alignas(1024) typename T::Element vt[T::kHeadDimVO * T::kBlockN];
  PageRow page_rows[T::kPagedKV ? T::kBlockN : 0];
};

// Block blockIdx.x for kv head blockIdx.y: gathered and transposed into shared memory as the
// producer does it for a gathered tile, then stored by one box of the map the prefill kernel
// loads it with (which lays the swizzled tile down plainly, and gives it back alike).
template <typename T>
__global__ void __launch_bounds__(T::kProducerThreads) transpose_v_kernel(const __grid_constant__ KernelArgs<T> args) {
  const auto& p = args.p;
  const auto* plan = static_cast<const int32_t*>(p.plan);
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<TransposeVStorage<T>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int block = blockIdx.x, kv_head = blockIdx.y, tid = threadIdx.x;
  common::wait_for_prior_grids();  // PDL: the plan and V may come from the kernel before
  // The block's request: the last whose first block is at or before it (empty requests have none).
  const int32_t* first_block = plan + p.off_vt_block;
  int request = 0;
  for (int hi = p.batch_size - 1; request < hi;) {
    const int mid = (request + hi + 1) / 2;
    if (first_block[mid] <= block) request = mid; else hi = mid - 1;
  }
  const int first = (block - first_block[request]) * T::kBlockN, end = plan[p.off_kv_len + request];
  const int kv_token_base = T::kPagedKV ? 0 : plan[p.off_kv_indptr + request];
  if constexpr (T::kPagedKV) {
    bool bad_page = false;  // the prefill kernel reads the same page ids for K, and reports them
    const auto* page_ids = static_cast<const int32_t*>(p.indices) + plan[p.off_kv_indptr + request];
    fill_page_table<T>(smem.page_rows, p, page_ids, common::FastDivmod(p.page_size), first, end, tid, bad_page);
    __syncthreads();
  }
  load_v_tile_transposed<T>(reinterpret_cast<uint8_t*>(smem.vt),
                            static_cast<const typename T::DTypeKV*>(p.v) + kv_head * p.v_stride_head, tid,
                            gathered_rows<T>(smem.page_rows, first, end, kv_token_base, p.v_stride_page, p.v_stride_token), 0);
  common::allow_dependent_grids();  // PDL: V is read; the prefill kernel may start its prologue
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  if (tid == 0) {
    cute::SM90_TMA_STORE_4D::copy(&args.vt_blocks, smem.vt, 0, 0, block, kv_head);
    cute::tma_store_arrive();
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // written, not only read out of shared memory
  }
}

// The transpose ahead of a V-transposed prefill launch (the module's prefill_run launches it before
// launch_prefill when p.v_transposed is set); kernels without that instantiation refuse.
template <typename T>
cudaError_t launch_transpose_v(const typename T::Params& p, cudaStream_t stream) {
  if constexpr (!T::kHasVtAhead) {
    return cudaErrorNotSupported;
  } else {
    if (p.vt_blocks == 0) return cudaSuccess;
    using Vt = typename T::WithVtAhead;
    KernelArgs<Vt> args{};
    args.p = p;
    const cudaError_t err = encode_vt_map<Vt>(args);
    if (err != cudaSuccess) return err;
    constexpr int kSmemBytes = int(sizeof(TransposeVStorage<Vt>)) + 1024;
    static_assert(kSmemBytes <= 48 * 1024, "fa3 V transpose: one block fits the default shared memory");
    return host::launch_kernel(transpose_v_kernel<Vt>, dim3(p.vt_blocks, p.num_kv_heads), dim3(Vt::kProducerThreads),
                               kSmemBytes, stream, p.enable_pdl != 0, args);
  }
}

}  // namespace attnforge::fa3
