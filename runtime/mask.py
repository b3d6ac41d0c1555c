"""Bit-packed custom masks, FlashInfer's `packbits` / `segment_packbits` and their inverse.

A prefill custom mask for request r is a boolean [qo_len, kv_len] matrix, flattened row-major
and packed eight elements to a byte; each request's bits start on a fresh byte. The kernels
read the bits LITTLE-endian (element i of a byte is bit i), so masks meant for them are packed
with bitorder="little". The default order is "big", as in FlashInfer and numpy, so that code
written for either packs the same bytes here.
"""

from __future__ import annotations

import torch

from . import checks

__all__ = ["packbits", "segment_packbits", "unpackbits"]

_BITORDERS = ("big", "little")


def _bit_weights(bitorder: str, device) -> torch.Tensor:
    """The value of element i of a group of eight: 2^i little-endian, 2^(7-i) big-endian."""
    if bitorder not in _BITORDERS:
        raise ValueError(f"bitorder: expected one of {_BITORDERS}, got {bitorder!r}")
    shifts = torch.arange(8, device=device)
    if bitorder == "big":
        shifts = 7 - shifts
    return torch.ones(8, dtype=torch.int32, device=device) << shifts


def _as_bits(x, name: str) -> torch.Tensor:
    checks.tensor(x, name)
    if x.is_floating_point() or x.is_complex():
        raise ValueError(f"{name}: expected a bool or integer tensor, got {x.dtype}")
    return x.reshape(-1) != 0


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack a binary tensor, flattened, into uint8 [ceil(numel / 8)] (numpy.packbits semantics:
    the last byte is zero-padded). Same device as x."""
    bits = _as_bits(x, "x")
    weights = _bit_weights(bitorder, bits.device)
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.int32, device=bits.device)
    padded[: bits.numel()] = bits
    return (padded.view(-1, 8) * weights).sum(-1).to(torch.uint8)


def unpackbits(packed: torch.Tensor, count: int, bitorder: str = "big") -> torch.Tensor:
    """The inverse of `packbits`: the first `count` bits of uint8 `packed` as bool [count]."""
    checks.tensor(packed, "packed")
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed: expected a 1-D torch.uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 8 * packed.numel():
        raise ValueError(f"count: expected an int in [0, {8 * packed.numel()}] (8 bits per byte of packed), "
                         f"got {count!r}")
    weights = _bit_weights(bitorder, packed.device)
    bits = (packed.to(torch.int32)[:, None] & weights) != 0  # [bytes, 8]
    return bits.reshape(-1)[:count]


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"):
    """Pack each segment x[indptr[i]:indptr[i+1]] of a 1-D binary tensor on its own whole bytes.

    Returns (packed uint8 [new_indptr[-1]] on x's device, new_indptr int32 [batch_size + 1] on
    indptr's device), with new_indptr[i+1] - new_indptr[i] = ceil(segment length / 8).
    """
    bits = _as_bits(x, "x")
    if x.dim() != 1:
        raise ValueError(f"x: expected a 1-D tensor (flatten each request's mask and concatenate), "
                         f"got shape {tuple(x.shape)}")
    bounds = checks.indptr(indptr, "indptr", end=bits.numel())
    segments = [packbits(bits[a:b], bitorder) for a, b in zip(bounds, bounds[1:])]
    sizes = torch.tensor([0] + [s.numel() for s in segments], dtype=torch.int32)
    packed = torch.cat(segments) if segments else bits.new_zeros(0, dtype=torch.uint8)
    return packed, torch.cumsum(sizes, 0, dtype=torch.int32).to(indptr.device)
