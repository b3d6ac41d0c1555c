"""Keys per kv tile of the FA2 kernels, which the split-KV planners round their chunks to.

These mirror fa2/decode_traits.cuh (DecodeTraits::kTileTokens) and fa2/prefill_traits.cuh
(PrefillTraits::kTileKV, and kVOSlices: prefill_vo_slices); FA3's is fa3_units.fa3_kv_tile. Every rendered variant static_asserts
the value it was rendered with, so a change on one side that the other misses fails the build.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fa3_units import fa3_cta_tile, fa3_kv_tile
from .spec import Backend, KernelSpec, PosEncoding

# Packed query rows per CTA the prefill kernel is compiled for (plan() picks one per batch).
PREFILL_CTA_TILES = (16, 64, 128)

DECODE_THREADS = 128
DECODE_WARPS = DECODE_THREADS // 32


# Little's law for the decode ring: ~4.3 TB/s of copy bandwidth (H200) times ~1 us of DRAM latency
# under load, over 132 SMs, is ~33 KB of loads in flight per SM; a ring must keep at least this
# much (~1.2x that) of real KV bytes, padding not counted, in flight per SM.
DECODE_MIN_BYTES_IN_FLIGHT_PER_SM = 40 * 1024
# Shared memory per SM on sm90 (228 KB, 227 KB for one CTA), 1 KB of it reserved per CTA, and an upper
# bound on what the decode CTA keeps beside its ring (lane-group rows, the MMA tile's P buffers and
# warp pairs' partial scores, the row offsets: at most ~5.6 KB, the warp-pair tile at 8 heads).
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA_MAX = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024
DECODE_SMEM_BESIDE_RING = 6 * 1024


@dataclass(frozen=True)
class DecodeTile:
    """The decode kernel's tile for one (spec, heads per CTA): fa2/decode_traits.cuh's kTileTokens,
    kRowDim, kStages, kMmaTile and kMinCtasPerSm (its launch bound), and what follows from them."""

    tokens: int  # rows of a K (and of a V) tile
    row_dim: int  # elements of a ring row, padding lanes included
    head_dim: int  # elements of a real row
    kv_bytes: int  # bytes of a KV element
    stages: int  # depth of the cp.async ring
    mma: bool  # the tensor-core tile (decode_mma.cuh), else the CUDA-core tile (decode_simt.cuh)

    @property
    def ring_bytes(self) -> int:
        return self.stages * 2 * self.tokens * self.row_dim * self.kv_bytes

    @property
    def min_ctas_per_sm(self) -> int:
        """The launch bound: 32 KB of K tiles per SM (4 CTAs of 8 KB tiles, 2 of the MMA tile's 16 KB)."""
        return 8192 * 4 // (self.tokens * self.row_dim * self.kv_bytes)

    @property
    def ctas_per_sm(self) -> int:
        """A lower bound on resident CTAs: the launch bound caps registers, shared memory may cap less."""
        per_cta = self.ring_bytes + DECODE_SMEM_BESIDE_RING + SMEM_RESERVED_PER_CTA
        return min(self.min_ctas_per_sm, SMEM_PER_SM // per_cta)

    @property
    def bytes_in_flight_per_sm(self) -> int:
        """Real K and V bytes a CTA has in flight while it consumes a tile (stages - 1 tiles ahead),
        times the CTAs per SM."""
        return self.ctas_per_sm * (self.stages - 1) * 2 * self.tokens * self.head_dim * self.kv_bytes


def decode_tile(spec: KernelSpec, heads_per_cta: int) -> DecodeTile:
    """The decode kernel's tile for heads_per_cta heads: 16 rows per warp (per warp pair for rows
    of 512 bytes) on the tensor-core tile, else 8 KB of K per tile (counting the ring row's padding
    lanes); a 3-stage ring either way.

    A row's 16-byte cells span the next power of two of lanes (the lane merges halve lane groups by
    shuffles), so hd 80, 96 and 112 of a 16-bit cache sit in 128-column ring rows and hd 160, 192
    and 224 in 256-column rows. The CUDA-core tile's padding lanes issue every load, conversion and
    FMA of a real lane, which makes a padded row issue-bound; the tensor-core tile takes 4-8 heads
    over ring rows of whole 128-byte lines, and its MMAs read only the hd / 16 real 16-dim chunks:
    16-bit hd 64 to 128 in 64-token tiles (16 rows a warp); 16-bit hd 160, 192 and 224 in 32-token
    tiles, a warp pair per 16 rows, each warp over half the chunks (64 tokens of 512-byte rows would
    make the ring 192 KB: one CTA per SM on sm90, none on sm80); fp8 hd 128 and 256. Not: a padded
    fp8 row (the MMA path splits a lane's K cells by hd / 4); an in-kernel position encoding (it
    rotates K cells on the CUDA-core tile); 16-bit hd 256, whose CUDA-core tile has no padding lanes
    and runs at the copy bandwidth (the pair tile would fit one CTA on sm80); hd 512 (two cells a
    lane)."""
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
           and (spec.head_dim_qk <= 128 or (kv_bytes == 1 and spec.head_dim_qk <= 256) or (kv_bytes == 2 and padded))
           and spec.pos_encoding is PosEncoding.NONE)
    warps_per_16_rows = 2 if row_dim * kv_bytes > 256 else 1  # DecodeTraits::kMmaSplit
    tokens = 16 * DECODE_WARPS // warps_per_16_rows if mma else 8192 // (row_dim * kv_bytes)
    return DecodeTile(tokens=tokens, row_dim=row_dim, head_dim=spec.head_dim_qk, kv_bytes=kv_bytes, stages=3, mma=mma)


def decode_kv_tile(spec: KernelSpec, heads_per_cta: int) -> int:
    """Keys per tile of the decode kernel serving heads_per_cta heads (decode_tile)."""
    return decode_tile(spec, heads_per_cta).tokens


def prefill_cta_tiles(spec: KernelSpec) -> tuple[int, ...]:
    """The prefill tiles a module compiles: FA3 has one; FA2 drops the 128-row tile where its o
    accumulators beside the scores would not fit the registers: head dims over 192 (224, 256, 512),
    and o past 160 columns ((192, 192): 644/824 B of spills at sm90a, where the 64-row tile has none).
    The planners take the tallest (PrefillPlanArgs.max_cta_tile_q). At 512 each tile's CTAs also
    split o's columns (prefill_vo_slices)."""
    if spec.backend is Backend.FA3:
        return (fa3_cta_tile(spec),)
    tall = spec.head_dim_qk <= 192 and spec.head_dim_vo <= 160
    return PREFILL_CTA_TILES if tall else PREFILL_CTA_TILES[:-1]


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
        # 16-bit hd 64 takes twice the keys too: as many bytes per tile as hd 128
        blocks = 4 if spec.head_dim_qk <= 64 and not spec.dtype_kv.is_fp8 else 2 if spec.head_dim_qk <= 128 else 1
        mma_kv = blocks * (2 if doubled else 1)
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
