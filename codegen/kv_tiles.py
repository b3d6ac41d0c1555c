"""Keys per kv tile of the FA2 kernels, which the split-KV planners round their chunks to.

These mirror fa2/decode_traits.cuh (DecodeTraits::kTileTokens) and fa2/prefill_traits.cuh
(PrefillTraits::kTileKV, and kVOSlices: prefill_vo_slices); FA3's is fa3_units.fa3_kv_tile. Every rendered variant static_asserts
the value it was rendered with, so a change on one side that the other misses fails the build.
"""

from __future__ import annotations

from .fa3_units import fa3_kv_tile
from .spec import Backend, KernelSpec, PosEncoding

DECODE_THREADS = 128
DECODE_WARPS = DECODE_THREADS // 32


def decode_kv_tile(spec: KernelSpec, heads_per_cta: int) -> int:
    """Tokens per tile of the decode kernel serving heads_per_cta heads: 16 per warp on the
    tensor-core tile, else 8 KB of K per tile (counting the ring row's padding lanes).

    The tensor-core tile takes 4-8 heads over ring rows of whole 128-byte lines: 16-bit hd 64 to 128
    (hd 80, 96 and 112 in 128-column rows whose padding its MMAs skip: on the CUDA-core tile those
    padding lanes issue as much as real ones, which left these dims issue-bound), fp8 hd 128 and
    256 (a padded fp8 row keeps the CUDA-core tile); not with an in-kernel position encoding, which
    rotates K cells on the CUDA-core tile. 16-bit rows past 128 columns keep the CUDA-core tile: a
    64-token ring of 256-column rows (192 KB) leaves one CTA per SM."""
    kv_bytes = spec.dtype_kv.bytes
    vec = 16 // kv_bytes  # KV elements per 16-byte load
    cells = spec.head_dim_qk // vec
    cells_per_lane = cells // 32 if cells > 32 else 1  # 16-bit hd 512: two cells on each of 32 lanes
    lanes = 1
    while lanes < cells // cells_per_lane:
        lanes *= 2
    row_dim = lanes * cells_per_lane * vec
    padded = row_dim != spec.head_dim_qk
    mma = (heads_per_cta >= 4 and (not padded or kv_bytes == 2) and lanes % 8 == 0 and cells_per_lane == 1
           and (spec.head_dim_qk <= 128 or (kv_bytes == 1 and spec.head_dim_qk <= 256))
           and spec.pos_encoding is PosEncoding.NONE)
    return 16 * DECODE_WARPS if mma else 8192 // (row_dim * kv_bytes)


def prefill_kv_tile(spec: KernelSpec, cta_tile_q: int, paged: bool) -> int:
    """Keys per tile of the prefill kernel with cta_tile_q packed q rows (fa2: n16 blocks per warp
    times the warps along kv; fa3: its kBlockN)."""
    if spec.backend is Backend.FA3:
        return fa3_kv_tile(spec, paged)
    warps_q = 1 if cta_tile_q == 16 else 4
    warps_kv = 4 // warps_q
    mma_q = cta_tile_q // (16 * warps_q)
    if warps_kv == 4:
        # an fp8 cache doubles the keys, unless RoPE adds its rotated fp16 K tile (kRotatedK16)
        doubled = spec.dtype_kv.is_fp8 and spec.pos_encoding is not PosEncoding.ROPE_LLAMA
        mma_kv = (2 if spec.head_dim_qk <= 128 else 1) * (2 if doubled else 1)
    elif mma_q == 2:
        mma_kv = 4
    elif prefill_vo_slices(spec) > 1:
        mma_kv = 2  # hd 512: Q 64 + K 32 + V slice 16 = 112 KB
    else:
        mma_kv = 8 if spec.head_dim_qk <= 128 else 4
    return mma_kv * warps_kv * 16


def prefill_vo_slices(spec: KernelSpec) -> int:
    """CTAs that share a prefill work item, each over a slice of o's columns (grid z; fa2 only): two
    256-column slices at head dim 512, whose fp32 o for 16 rows would otherwise take 256 registers a
    thread; one below (PrefillTraits::kVOSlices)."""
    if spec.backend is Backend.FA3:
        return 1
    return 2 if spec.head_dim_vo > 256 else 1
