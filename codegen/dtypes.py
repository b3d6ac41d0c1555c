"""The one table of data types: every attribute a dtype has lives on its enum member."""

from __future__ import annotations

from enum import Enum


class DType(Enum):
    """Element types of q, k/v and o.

    Each member carries (short name, C++ type, torch dtype name, bits, is_fp8); nothing else in
    the project maps dtypes by hand.
    """

    FP16 = ("fp16", "half", "float16", 16, False)
    BF16 = ("bf16", "__nv_bfloat16", "bfloat16", 16, False)
    E4M3 = ("e4m3", "__nv_fp8_e4m3", "float8_e4m3fn", 8, True)
    E5M2 = ("e5m2", "__nv_fp8_e5m2", "float8_e5m2", 8, True)

    def __init__(self, short: str, cpp: str, torch_name: str, bits: int, is_fp8: bool):
        self.short = short
        self.cpp = cpp
        self.torch_name = torch_name
        self.bits = bits
        self.is_fp8 = is_fp8

    @property
    def bytes(self) -> int:
        return self.bits // 8

    @property
    def default_output(self) -> "DType":
        """The o dtype a query of this dtype gets when none is asked for: its own, and bf16 for an
        fp8 query (no kernel writes fp8)."""
        return DType.BF16 if self.is_fp8 else self

    @classmethod
    def parse(cls, text: str) -> "DType":
        """Accept the short name ("bf16") or the torch name ("bfloat16")."""
        for member in cls:
            if text in (member.short, member.torch_name):
                return member
        names = ", ".join(m.short for m in cls)
        raise ValueError(f"unknown dtype {text!r}; expected one of {names}")


class IndexType(Enum):
    """Integer type of indptr / page indices."""

    I32 = ("i32", "int32_t", "int32", 32)

    def __init__(self, short: str, cpp: str, torch_name: str, bits: int):
        self.short = short
        self.cpp = cpp
        self.torch_name = torch_name
        self.bits = bits

    @classmethod
    def parse(cls, text: str) -> "IndexType":
        for member in cls:
            if text in (member.short, member.torch_name):
                return member
        raise ValueError(f"unknown index type {text!r}; expected one of {', '.join(m.short for m in cls)}")
