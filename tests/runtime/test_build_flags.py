"""Per-backend build flags: FA3 modules get the CuTe headers (the few units that need CuTe's extended
wgmma shapes define them themselves, tests/codegen/test_fa3_units.py); a ptxas report of serialized wgmma (C7510, C7512, C7520) fails the build. No compiler runs here."""

from __future__ import annotations

import stat
from pathlib import Path
from dataclasses import replace

import pytest

from attnforge import build as build_module
from attnforge.build import BuildError, cutlass_include, ninja_file
from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind
from attnforge.settings import settings

FA2 = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                 dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))
FA3 = replace(FA2, backend=Backend.FA3)


def _config(**changes):
    return replace(settings(), nvcc="/usr/bin/true", **changes)


def test_fa3_modules_get_cute_headers_but_not_every_unit_the_extended_shapes(tmp_path):
    text = ninja_file(FA3, tmp_path, "m.so", _config())
    assert "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" not in text, "those headers cost ~30 s per unit that parses them"
    include = cutlass_include(_config())
    assert (include / "cute" / "tensor.hpp").is_file()
    assert f"-I{include}" in text
    assert "-gencode=arch=compute_90a,code=sm_90a" in text and "-DNDEBUG" in text


def test_fa2_modules_do_not_pull_in_cutlass(tmp_path):
    text = ninja_file(FA2, tmp_path, "m.so", _config())
    assert "CUTE_SM90" not in text and "cutlass" not in text.lower()


def test_cutlass_dir_overrides_the_wheel(tmp_path):
    (tmp_path / "include" / "cute").mkdir(parents=True)
    (tmp_path / "include" / "cute" / "tensor.hpp").write_text("")
    assert cutlass_include(_config(cutlass_dir=tmp_path)) == tmp_path / "include"


def test_cutlass_dir_without_headers_is_refused(tmp_path):
    with pytest.raises(BuildError, match="CUTLASS_DIR"):
        cutlass_include(_config(cutlass_dir=tmp_path))


def _ninja_printing(tmp_path, monkeypatch, line: str) -> None:
    """Stand in a 'ninja' that succeeds after printing one line of compiler output."""
    fake = tmp_path / "ninja"
    fake.write_text(f"#!/bin/sh\necho \"{line}\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(build_module, "_ninja", lambda: str(fake))


@pytest.mark.parametrize("report", [
    "ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to the "
    "presence of Extern calls",
    "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
    "program dependence on compiler-inserted WG.AR in divergent path in the function 'k'",
    "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
    "insufficient register resources for the function 'k'",
], ids=["C7510", "C7520", "C7512"])
def test_serialized_wgmma_report_fails_the_build(tmp_path, monkeypatch, report):
    _ninja_printing(tmp_path, monkeypatch, report)
    with pytest.raises(BuildError, match="serialized wgmma") as raised:
        build_module._run_ninja(tmp_path, _config(verbose=False))
    assert report.split(":")[1].split(")")[0].strip(" (") in str(raised.value)


@pytest.mark.parametrize("changes", [{"extra_cuda_flags": ("-lineinfo",)}, {"cutlass_dir": Path("/opt/cutlass")}],
                         ids=["extra_cuda_flags", "cutlass_dir"])
def test_build_options_outside_the_uri_get_a_cache_folder_of_their_own(tmp_path, changes):
    """The uri covers the spec, the sources and attnforge's own flags, not the user's: a module built
    with ATTNFORGE_EXTRA_CUDAFLAGS or a CUTLASS_DIR must not load as (or over) the plain one."""
    plain = _config(cache_dir=tmp_path, extra_cuda_flags=(), cutlass_dir=None)
    other = replace(plain, **changes)
    assert build_module.module_dir(FA3, plain) == tmp_path / build_module.version() / FA3.uri
    assert build_module.module_dir(FA3, other).parent.parent == plain.cache_dir / build_module.version()
    assert build_module.module_dir(FA3, other).parent.name.startswith("options-")
    assert build_module.module_dir(FA3, other) == build_module.module_dir(FA3, replace(other))  # stable
    assert build_module.module_dir(FA3, other) != build_module.module_dir(
        FA3, replace(other, extra_cuda_flags=("-lineinfo", "-G")))
