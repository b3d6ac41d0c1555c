"""Fixtures shared by the codegen tests."""

from __future__ import annotations

import pytest

from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind


@pytest.fixture
def decode_spec() -> KernelSpec:
    """A spec every rule accepts: bf16 FA2 decode, head dim 128, for sm80. Tests derive the spec
    they need from it with dataclasses.replace, so each changes exactly one thing."""
    return KernelSpec(
        kind=Kind.DECODE,
        backend=Backend.FA2,
        dtype_q=DType.BF16,
        dtype_kv=DType.BF16,
        dtype_o=DType.BF16,
        head_dim_qk=128,
        head_dim_vo=128,
        archs=(Arch.SM80,),
    )
