"""The FA3 prefill kernel's compile-time choices that rendering needs: its tiles, and the
instantiations launch_prefill picks from (fa3/kernel.cuh), each compiled in a translation unit of
its own so ninja builds them in parallel.

These mirror fa3/traits.cuh (PrefillTraits); every rendered unit static_asserts the values it was
rendered with, so a change on one side that the other misses fails the build instead of building a
module whose planner and kernel disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import KernelSpec

# The wgmma widths (N) CuTe's op selectors know without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED. The
# extended set's headers cost ~30 s of nvcc front end per unit (a 16-bit hd 128 unit: 46 s of CPU
# with them, 20 s without), so only units whose tiles need another width define the macro, and
# only for nvcc's device pass (the host pass, which issues no wgmma, paid ~20 s of it). Within
# this set the selector picks the same op with or without it (the tile's own width comes first).
CUTE_BASE_WGMMA_WIDTHS = frozenset((8, 16, 32, 64, 96, 128, 192, 256))


def fa3_cta_tile(spec: KernelSpec) -> int:
    """The FA3 kernel's one tile: a consumer warpgroup per 64 rows, three at 16-bit head dim 64, at
    16-bit head dims 80-128 (qk = vo) without soft cap or window, and fp8 up to head dim 128
    (fa3/traits.cuh, PrefillTraits::kConsumerWarpgroups), else two."""
    if spec.dtype_kv.is_fp8:
        three = spec.head_dim_vo <= 128
    else:
        three = spec.head_dim_qk == spec.head_dim_vo == 64 or (
            spec.head_dim_qk == spec.head_dim_vo and 80 <= spec.head_dim_qk <= 128 and not spec.use_sliding_window
            and not spec.use_logits_soft_cap)
    return 192 if three else 128


def fa3_line_bytes(spec: KernelSpec, head_dim: int) -> int:
    """The swizzle line of a tile whose rows hold `head_dim` elements (fa3/traits.cuh, line_bytes): the
    widest of 128, 64 and 32 bytes that divides the row (16-bit hd 96, 160, 224: 64; 80, 112: 32; fp8
    64, 192: 64; 96: 32). fp8 V's staged rows keep 128-byte lines (PrefillTraits::kStagingDimVO); its
    transposed tile's rows are the dims themselves."""
    row = head_dim * spec.dtype_kv.bytes
    return next(line for line in (128, 64, 32) if row % line == 0)


def fa3_tile_dim(spec: KernelSpec, head_dim: int) -> int:
    """A head dim as the prefill kernel's tiles hold it (PrefillTraits::kTileDimQK/VO): whole swizzle
    lines (fa3_line_bytes), the head dim itself at every dim the rules accept. The rendered units
    static_assert it."""
    line = fa3_line_bytes(spec, head_dim) // spec.dtype_kv.bytes
    return -(-head_dim // line) * line


def fa3_kv_tile(spec: KernelSpec, paged: bool) -> int:
    """Keys per tile (PrefillTraits::kBlockN): 128, 64 for 16-bit tile dims over 320 in all or a qk
    tile dim over 192, of which ragged kernels without soft cap or window take 112 at a qk tile dim
    of 192 (hd 192), else 80 (hd 224, 256)."""
    tile_qk = fa3_tile_dim(spec, spec.head_dim_qk)
    if spec.dtype_kv.is_fp8 or (tile_qk + fa3_tile_dim(spec, spec.head_dim_vo) <= 320 and tile_qk <= 192):
        return 128
    wide = not paged and not spec.use_logits_soft_cap and not spec.use_sliding_window
    return (112 if tile_qk <= 192 else 80) if wide else 64


def fa3_extended_wgmma(spec: KernelSpec, paged: bool) -> bool:
    """Whether the kernel's wgmmas (Q K^T: N = keys per tile; P V: N = the V tile dim) need a width
    outside CuTe's base set."""
    return not {fa3_kv_tile(spec, paged), fa3_tile_dim(spec, spec.head_dim_vo)} <= CUTE_BASE_WGMMA_WIDTHS


@dataclass(frozen=True)
class Instance:
    """An instantiation launch_prefill may pick besides the prefill kernel: `traits` names it as a
    member of the prefill kernel's traits, `flag` is the traits constant that says it exists."""

    name: str
    traits: str
    flag: str


VT_AHEAD = Instance("vt_ahead", "WithVtAhead", "kHasVtAhead")
DECODE_ROWS_64 = Instance("decode64", "WithDecodeRows<64>", "kHasDecodeItems")
DECODE_ROWS_8 = Instance("decode8", "WithDecodeRows<8>", "kHasKeysAlongM")
INSTANCES = (VT_AHEAD, DECODE_ROWS_64, DECODE_ROWS_8)


def fa3_instances(spec: KernelSpec, paged: bool) -> tuple[Instance, ...]:
    """The instantiations besides the prefill one: V transposed ahead (fp8), decode items (fp8
    paged), with the keys along M up to head dim 128."""
    fp8 = spec.dtype_kv.is_fp8
    small = spec.head_dim_qk <= 128 and spec.head_dim_vo <= 128
    present = {VT_AHEAD: fp8, DECODE_ROWS_64: fp8 and paged, DECODE_ROWS_8: fp8 and paged and small}
    return tuple(instance for instance in INSTANCES if present[instance])
