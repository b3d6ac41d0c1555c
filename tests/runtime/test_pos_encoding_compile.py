"""A CUDA-core decode module with in-kernel RoPE compiles for sm_80 and loads (nvcc, no GPU): the
RoPE path (decode_simt.cuh's rope_cell over common::rope_rotate) is compile-time gated, so only a
module that selects it builds it."""

from __future__ import annotations

import pytest

from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import check
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding
from attnforge.loader import load_uncached

pytestmark = pytest.mark.nvcc


def test_rope_decode_compiles_and_loads(module_cache, monkeypatch):
    spec = KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, pos_encoding=PosEncoding.ROPE_LLAMA,
                      archs=(Arch.SM80,))
    assert check(spec) == []
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(module_cache))
    module = load_uncached(spec)
    assert module.spec == spec
