"""Programmatic dependent launch without a GPU: the flag in the C ABI, run()'s enable_pdl semantics
(FlashInfer's: None is on where the device is sm90+, True a request honoured only there), and the
machine code: every sm_90a kernel waits on its predecessor (griddepcontrol.wait, ACQBULK in SASS)
before its first global memory access, and sm_80 kernels carry neither instruction."""

from __future__ import annotations

import re

import pytest

from attnforge import checks, dispatch
from attnforge.codegen.abi import DECODE_PARAMS, PREFILL_PARAMS
from attnforge.codegen.dtypes import DType
from attnforge.codegen.render import render
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind


def _spec(kind: Kind, backend: Backend, arch: Arch) -> KernelSpec:
    return KernelSpec(kind=kind, backend=backend, dtype_q=DType.BF16, dtype_kv=DType.BF16, dtype_o=DType.BF16,
                      head_dim_qk=128, head_dim_vo=128, archs=(arch,))


@pytest.mark.parametrize("struct", [DECODE_PARAMS, PREFILL_PARAMS], ids=lambda s: s.name)
def test_params_carry_the_flag(struct):
    field = {f.name: f for f in struct.fields}["enable_pdl"]
    assert field.ctype == "int32_t"


@pytest.mark.parametrize("kind", [Kind.DECODE, Kind.PREFILL])
def test_rendered_module_declares_and_mirrors_the_flag(kind):
    files = render(_spec(kind, Backend.FA2, Arch.SM80)).files
    params = "DecodeParams" if kind is Kind.DECODE else "PrefillParams"
    assert re.search(rf"struct {params} \{{[^}}]*int32_t enable_pdl;", files["config.cuh"])
    assert '("enable_pdl", ctypes.c_int32)' in files["binding.py"]
    if kind is Kind.PREFILL:  # the split-KV merge launches with the run's flag too
        assert "launch_merge_partials<DTypeO, kHeadDimVO>(merge, stream, params->enable_pdl != 0)" in files["entry.cu"]
    else:  # decode merges split requests inside its kernel: one launch per run
        assert "launch_merge_partials" not in files["entry.cu"]


def test_run_extras_accept_enable_pdl():
    for value in (None, True, False):
        checks.run_extras(-1, value, None)
    with pytest.raises(ValueError, match="enable_pdl: expected True, False or None"):
        checks.run_extras(-1, "yes", None)


@pytest.mark.parametrize("major, enable_pdl, flag", [
    (9, None, 1), (9, True, 1), (9, False, 0), (10, None, 1),
    (8, None, 0), (8, True, 0), (8, False, 0),  # a request, honoured only on sm90+ (as FlashInfer)
])
def test_pdl_flag_follows_the_device(monkeypatch, major, enable_pdl, flag):
    monkeypatch.setattr(dispatch.torch.cuda, "get_device_capability", lambda index: (major, 0))
    dispatch.device_has_pdl.cache_clear()
    try:
        assert dispatch.pdl_flag(enable_pdl, 0) == flag
    finally:
        dispatch.device_has_pdl.cache_clear()


# ---------------------------------------------------------------------------------------
# machine code (nvcc)

SPECS = {"decode_sm80": _spec(Kind.DECODE, Backend.FA2, Arch.SM80),
         "decode_sm90a": _spec(Kind.DECODE, Backend.FA2, Arch.SM90A),
         "prefill_sm80": _spec(Kind.PREFILL, Backend.FA2, Arch.SM80),
         "prefill_sm90a": _spec(Kind.PREFILL, Backend.FA2, Arch.SM90A),
         "fa3_sm90a": _spec(Kind.PREFILL, Backend.FA3, Arch.SM90A)}
# The first instruction of a kernel that touches global memory: loads, stores, atomics, cp.async,
# TMA and bulk copies (parameters, TMA descriptors included, live in the constant bank, which no
# kernel writes: reading or prefetching them may precede the wait).
GLOBAL_ACCESS = re.compile(r"(LDG|STG|ATOMG|RED|LDGSTS|UTMALDG|UTMASTG|UBLKCP|LD|ST|ATOM)(\.|$)")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)")


def _kernels(sass: str) -> dict[str, list[str]]:
    """{mangled kernel name: its SASS opcodes in order} of a module's disassembly."""
    kernels = {}
    for section in sass.split("Function : ")[1:]:
        lines = section.splitlines()
        kernels[lines[0].strip()] = [m.group(1) for m in map(INSTRUCTION.match, lines[1:]) if m]
    return kernels


@pytest.fixture(scope="module")
def sass(module_cache, sass_of):
    from attnforge.loader import load_uncached

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNFORGE_CACHE_DIR", str(module_cache))
        return {name: _kernels(sass_of(load_uncached(spec).path)) for name, spec in SPECS.items()}


@pytest.mark.nvcc
@pytest.mark.parametrize("name", [n for n in SPECS if n.endswith("sm90a")])
def test_every_sm90_kernel_waits_before_touching_global_memory(sass, name):
    kernels = sass[name]
    expected = {"decode_kernel"} if name.startswith("decode") else \
        {"prefill_kernel", "merge_partials_kernel"} | ({"gather_pages_kernel"} if name.startswith("fa3") else set())
    assert {k for k in expected if any(k in mangled for mangled in kernels)} == expected
    for mangled, ops in kernels.items():
        assert "ACQBULK" in ops, f"{mangled}: no griddepcontrol.wait"
        first_access = next(i for i, op in enumerate(ops) if GLOBAL_ACCESS.match(op))
        assert ops.index("ACQBULK") < first_access, f"{mangled}: {ops[first_access]} before griddepcontrol.wait"
        assert "PREEXIT" in ops, f"{mangled}: no griddepcontrol.launch_dependents"


@pytest.mark.nvcc
@pytest.mark.parametrize("name", [n for n in SPECS if n.endswith("sm80")])
def test_sm80_kernels_hold_no_pdl_instructions(sass, name):
    for mangled, ops in sass[name].items():
        assert not {"ACQBULK", "PREEXIT"} & set(ops), mangled
