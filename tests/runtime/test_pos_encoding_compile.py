"""Modules with in-kernel RoPE compile and load (nvcc, no GPU): the RoPE paths are compile-time gated,
so only a module that selects them builds them. A CUDA-core decode module (decode_simt.cuh's
rope_cell over common::rope_rotate) for sm_80, and an fa2 prefill module over an e5m2 cache (its K
tiles rotated into an fp16 copy, halved: prefill_loads.cuh's rope_k_tile) for sm_90a, every q tile,
paged and ragged, so each tile's shared memory (the fp16 K tile added) is checked against two CTAs
per SM."""

from __future__ import annotations

import pytest

from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import check
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding
from attnforge.loader import load_uncached

pytestmark = pytest.mark.nvcc


SPECS = [
    KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16, dtype_o=DType.BF16,
               head_dim_qk=128, head_dim_vo=128, pos_encoding=PosEncoding.ROPE_LLAMA, archs=(Arch.SM80,)),
    KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.E5M2, dtype_o=DType.BF16,
               head_dim_qk=128, head_dim_vo=128, pos_encoding=PosEncoding.ROPE_LLAMA, archs=(Arch.SM90A,)),
]


@pytest.mark.parametrize("spec", SPECS, ids=["decode_sm80", "prefill_fp8_kv_sm90a"])
def test_rope_module_compiles_and_loads(spec, module_cache, monkeypatch):
    assert check(spec) == []
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(module_cache))
    module = load_uncached(spec)
    assert module.spec == spec
