"""attnforge.quantization: FlashInfer's bit-packing functions at FlashInfer's path (the
implementations, and their inverse unpackbits, live in attnforge.mask)."""

from __future__ import annotations

from .mask import packbits, segment_packbits

__all__ = ["packbits", "segment_packbits"]
