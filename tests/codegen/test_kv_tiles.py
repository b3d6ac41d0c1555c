"""The decode tile choice (codegen/kv_tiles.decode_tile), device-free: every supported decode spec
keeps enough real KV bytes in flight per SM and fits shared memory, and padded 16-bit rows (128 and
256 columns) take the tensor-core tile. The rendered units static_assert the same numbers against
DecodeTraits, so these properties hold for the kernel as built."""

from __future__ import annotations

import itertools

import pytest

from attnforge.codegen.dtypes import DType
from attnforge.codegen.kv_tiles import (DECODE_MIN_BYTES_IN_FLIGHT_PER_SM, DECODE_SMEM_BESIDE_RING, SMEM_PER_CTA_MAX,
                                        decode_tile)
from attnforge.codegen.render import DECODE_HEADS_PER_CTA
from attnforge.codegen.rules import DECODE_HEAD_DIMS, check
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding

# sm80's opt-in shared memory per CTA (163 KB): fa2 decode modules also build for it.
SMEM_PER_CTA_MAX_SM80 = 163 * 1024


def _decode_specs():
    for (qk, vo), dtype_kv, pos in itertools.product(sorted(DECODE_HEAD_DIMS), DType, PosEncoding):
        dtype_q = DType.BF16 if dtype_kv.is_fp8 else dtype_kv
        spec = KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_q,
                          head_dim_qk=qk, head_dim_vo=vo, pos_encoding=pos, archs=(Arch.SM80, Arch.SM90A))
        if not check(spec):
            yield spec


SPECS = list(_decode_specs())


def _name(spec: KernelSpec) -> str:
    return f"{spec.dtype_kv.name.lower()}-hd{spec.head_dim_qk}-{spec.pos_encoding.name.lower()}"


def test_every_decode_head_dim_is_covered():
    assert {s.head_dim_qk for s in SPECS} == {qk for qk, _ in DECODE_HEAD_DIMS}


@pytest.mark.parametrize("spec", SPECS, ids=_name)
@pytest.mark.parametrize("heads", DECODE_HEADS_PER_CTA)
def test_ring_keeps_enough_bytes_in_flight_and_fits(spec, heads):
    tile = decode_tile(spec, heads)
    smem = tile.ring_bytes + DECODE_SMEM_BESIDE_RING
    assert smem <= SMEM_PER_CTA_MAX_SM80 <= SMEM_PER_CTA_MAX
    assert tile.ctas_per_sm >= 1
    assert tile.bytes_in_flight_per_sm >= DECODE_MIN_BYTES_IN_FLIGHT_PER_SM, tile


@pytest.mark.parametrize("spec", SPECS, ids=_name)
@pytest.mark.parametrize("heads", [4, 8])
def test_padded_16bit_rows_up_to_128_columns_skip_their_padding_lanes(spec, heads):
    """A 16-bit hd 80/96/112 row sits in 128 columns; on the CUDA-core tile its padding lanes would
    issue as much as real ones, so without a position encoding it takes the tensor-core tile."""
    tile = decode_tile(spec, heads)
    if spec.dtype_kv.bytes == 2 and tile.row_dim <= 128 and spec.pos_encoding is PosEncoding.NONE:
        assert tile.mma and tile.tokens == 64
    if spec.pos_encoding is not PosEncoding.NONE:
        assert not tile.mma


@pytest.mark.parametrize("spec", SPECS, ids=_name)
@pytest.mark.parametrize("heads", DECODE_HEADS_PER_CTA)
def test_padded_16bit_rows_of_256_columns_take_the_warp_pair_tile(spec, heads):
    """A 16-bit hd 160/192/224 row sits in 256 columns (512 bytes): at 4-8 heads without a position
    encoding it takes the tensor-core tile in 32-token tiles (a warp pair per 16 rows), whose ring
    (96 KB) leaves 2 CTAs per SM on sm90 and fits sm80; below 4 heads it keeps the CUDA-core tile."""
    if spec.dtype_kv.bytes != 2 or spec.head_dim_qk not in (160, 192, 224):
        return
    tile = decode_tile(spec, heads)
    assert tile.row_dim == 256
    if heads >= 4 and spec.pos_encoding is PosEncoding.NONE:
        assert tile.mma and tile.tokens == 32 and tile.ring_bytes == 96 * 1024, tile
        assert tile.min_ctas_per_sm == 2 and tile.ctas_per_sm == 2, tile
        assert tile.ring_bytes + DECODE_SMEM_BESIDE_RING <= SMEM_PER_CTA_MAX_SM80
    else:
        assert not tile.mma and tile.tokens == 16, tile


@pytest.mark.parametrize("head_dim,row_dim,mma,tokens,ctas,kib_in_flight", [
    (64, 64, True, 64, 4, 128), (80, 128, True, 64, 2, 80), (96, 128, True, 64, 2, 96),
    (112, 128, True, 64, 2, 112), (128, 128, True, 64, 2, 128), (160, 256, True, 32, 2, 80),
    (192, 256, True, 32, 2, 96), (224, 256, True, 32, 2, 112), (256, 256, False, 16, 4, 128),
    (512, 512, False, 8, 4, 128),
])
def test_bf16_tiles_at_four_heads(head_dim, row_dim, mma, tokens, ctas, kib_in_flight):
    """The table of issue 38 (bf16, GQA group 4): ring row, tile, CTAs per SM, real KB in flight."""
    spec = KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=head_dim, head_dim_vo=head_dim, archs=(Arch.SM90A,))
    tile = decode_tile(spec, 4)
    assert (tile.row_dim, tile.mma, tile.tokens, tile.ctas_per_sm, tile.bytes_in_flight_per_sm // 1024) == (
        row_dim, mma, tokens, ctas, kib_in_flight)
