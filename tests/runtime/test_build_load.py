"""Build and load without a GPU: cache layout, cache hits, failed builds, the layout check, the
first-use log, and two processes building one module at once (needs nvcc, no GPU)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from attnforge import build as build_module
from attnforge.build import BuildError, library_path, module_dir
from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind
from attnforge.loader import ModuleLoadError, load_uncached, open_library

pytestmark = pytest.mark.nvcc


def decode_spec(archs, head_dim: int = 128, dtype_kv: DType = DType.BF16) -> KernelSpec:
    return KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=dtype_kv,
                      dtype_o=DType.BF16, head_dim_qk=head_dim, head_dim_vo=head_dim, archs=archs)


def prefill_spec(archs, dtype_kv: DType = DType.BF16) -> KernelSpec:
    return KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=dtype_kv,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=archs)


SPECS = {"sm80": decode_spec((Arch.SM80,)), "sm90a": decode_spec((Arch.SM90A,)),
         "fp8_kv_sm80": decode_spec((Arch.SM80,), dtype_kv=DType.E4M3),
         "fp8_kv_sm90a": decode_spec((Arch.SM90A,), dtype_kv=DType.E4M3),
         "prefill_sm80": prefill_spec((Arch.SM80,)), "prefill_sm90a": prefill_spec((Arch.SM90A,)),
         # sm80 widens e4m3 in software, sm90a with cvt; e5m2 is a byte move on both
         "prefill_e4m3_kv_sm80": prefill_spec((Arch.SM80,), DType.E4M3),
         "prefill_e4m3_kv_sm90a": prefill_spec((Arch.SM90A,), DType.E4M3),
         "prefill_e5m2_kv_sm90a": prefill_spec((Arch.SM90A,), DType.E5M2),
         "fa3_sm90a": replace(prefill_spec((Arch.SM90A,)), backend=Backend.FA3),
         "fa3_e4m3_sm90a": replace(prefill_spec((Arch.SM90A,)), backend=Backend.FA3, dtype_q=DType.E4M3,
                                   dtype_kv=DType.E4M3)}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def cache(module_cache):
    """The run's shared module cache, set in the environment for the whole module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNFORGE_CACHE_DIR", str(module_cache))
        yield module_cache


@pytest.fixture(scope="module")
def built(cache):
    """Every module of SPECS loaded once, with the log lines their loads emitted (None for a module an
    earlier test of the run had already built into the shared cache)."""
    logger = logging.getLogger("attnforge")
    out = {}
    for name, spec in SPECS.items():
        if library_path(spec).exists():
            out[name] = (load_uncached(spec), None)
            continue
        records = _Records()
        logger.addHandler(records)
        try:
            out[name] = (load_uncached(spec), records.messages)
        finally:
            logger.removeHandler(records)
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_module_compiles_and_loads_without_gpu(built, name):
    module, _ = built[name]
    assert module.spec == SPECS[name]
    assert module.path == library_path(SPECS[name])
    kind = module.spec.kind.value
    assert set(module.fns) >= {"last_error", "abi", f"{kind}_plan", f"{kind}_occupancy", f"{kind}_run"}
    assert isinstance(module.last_error(), str)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_cache_layout(built, cache, name):
    spec = SPECS[name]
    folder = module_dir(spec)
    assert folder.parent.parent == cache
    assert (folder / f"{spec.uri}.so").is_file()
    assert (folder / "src" / "binding.py").is_file()
    metadata = json.loads((folder / "src" / "metadata.json").read_text())
    assert metadata
    assert (folder / "build" / "build.ninja").is_file()
    assert not list(folder.glob("*.staged")) and not (folder / "build" / f"{spec.uri}.so.staged").exists()
    assert (folder.parent / f"{spec.uri}.lock").exists()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_first_use_is_logged_with_elapsed_time(built, name):
    _, messages = built[name]
    if messages is None:
        pytest.skip("an earlier test of this run built the module into the shared cache")
    uri = SPECS[name].uri
    assert f"compiling {uri} (first use)" in messages
    assert any(re.fullmatch(rf"compiled {re.escape(uri)} in \d+\.\d s", m) for m in messages), messages


def test_second_load_is_a_cache_hit_without_compiler(built, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise AssertionError("a cache hit ran ninja")

    monkeypatch.setattr(build_module, "_run_ninja", no_compiler)
    caplog.set_level(logging.DEBUG, logger="attnforge")
    module = load_uncached(SPECS["sm80"])
    assert module.path == built["sm80"][0].path
    assert not any("compiling" in m for m in caplog.messages)


def test_failed_build_leaves_no_library(cache, monkeypatch):
    spec = decode_spec((Arch.SM80,), head_dim=64)

    def failing_ninja(build_dir, config, jobserver=None):
        # A build that dies after writing part of its output.
        (build_dir / f"{spec.uri}.so.staged").write_bytes(b"\x7fELF half")
        raise BuildError(f"ninja failed in {build_dir} (exit 1): simulated")

    monkeypatch.setattr(build_module, "_run_ninja", failing_ninja)
    with pytest.raises(BuildError, match="simulated"):
        load_uncached(spec)
    assert not library_path(spec).exists()
    assert not list(module_dir(spec).glob("*.so"))


def _copy_with_binding_edit(built, tmp_path, edit) -> tuple[KernelSpec, object]:
    spec = SPECS["sm80"]
    copy = tmp_path / spec.uri
    shutil.copytree(built["sm80"][0].path.parent, copy)
    binding = copy / "src" / "binding.py"
    text = binding.read_text()
    edited = edit(text)
    assert edited != text
    binding.write_text(edited)
    return spec, copy / f"{spec.uri}.so"


def test_layout_check_accepts_an_unedited_copy(built, tmp_path):
    spec = SPECS["sm80"]
    copy = tmp_path / spec.uri
    shutil.copytree(built["sm80"][0].path.parent, copy)
    assert open_library(spec, copy / f"{spec.uri}.so").fns["decode_plan"] is not None


def test_layout_check_refuses_a_binding_missing_a_field(built, tmp_path):
    spec, library = _copy_with_binding_edit(
        built, tmp_path, lambda text: text.replace('        ("max_chunks", ctypes.c_int32),\n', ""))
    with pytest.raises(ModuleLoadError, match="layout"):
        open_library(spec, library)


def test_layout_check_refuses_a_binding_with_reordered_fields(built, tmp_path):
    def swap(text):
        q, n = '        ("q", ctypes.c_void_p),\n', '        ("batch_size", ctypes.c_int32),\n'
        return text.replace(q, "@Q@").replace(n, q).replace("@Q@", n)

    spec, library = _copy_with_binding_edit(built, tmp_path, swap)
    with pytest.raises(ModuleLoadError, match="layout"):
        open_library(spec, library)


def test_layout_check_refuses_swapped_fields_of_one_type(built, tmp_path):
    def swap(text):
        a, b = '        ("num_work", ctypes.c_int32),\n', '        ("num_partials", ctypes.c_int32),\n'
        return text.replace(a, "@A@").replace(b, a).replace("@A@", b)

    spec, library = _copy_with_binding_edit(built, tmp_path, swap)
    with pytest.raises(ModuleLoadError, match="layout"):
        open_library(spec, library)


def test_loader_refuses_a_binding_for_another_uri(built):
    with pytest.raises(ModuleLoadError, match="binding is for"):
        open_library(SPECS["sm90a"], built["sm80"][0].path)


def test_two_processes_build_once(tmp_path):
    spec = SPECS["sm80"]
    code = textwrap.dedent(f"""
        import json
        from attnforge.codegen.spec import KernelSpec
        from attnforge.loader import load_uncached
        module = load_uncached(KernelSpec.from_dict(json.loads({json.dumps(json.dumps(spec.to_dict()))})))
        print("loaded", module.path)
    """)
    env = {**os.environ, "ATTNFORGE_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
        assert "loaded" in output
    assert sum("compiling" in output for output in outputs) == 1, outputs
    folder = tmp_path / build_module.version() / spec.uri
    assert (folder / f"{spec.uri}.so").is_file()
    log_lines = (folder / "build" / ".ninja_log").read_text().splitlines()
    outputs_built = [line.split("\t")[3] for line in log_lines if not line.startswith("#")]
    objects = [name for name in outputs_built if name.endswith(".o")]
    assert objects and len(objects) == len(set(objects)), outputs_built
    assert sorted(objects) == sorted(p.name + ".o" for p in (folder / "src").glob("*.cu"))


# (module, its wgmma's SASS mnemonic, batches per wait at least): the fp8 wgmma has twice the K of
# a 16-bit one, so half the instructions per tile meet the same four waits.
FA3_SASS = [("fa3_sm90a", "HGMMA.", 4), ("fa3_e4m3_sm90a", "QGMMA.64x128x32.F32.E4M3.E4M3", 2)]


@pytest.mark.parametrize("name, gmma, per_wait", FA3_SASS, ids=[name for name, *_ in FA3_SASS])
def test_fa3_module_sass_holds_hgmma(built, sass_of, name, gmma, per_wait):
    """The fa3 kernels issue wgmma (HGMMA, or QGMMA with e4m3 operands, in SASS): a build that fell
    back to anything else would pass every functional test at a fraction of the speed."""
    module, _ = built[name]
    sass = sass_of(module.path)
    assert gmma in sass
    # ptxas may also serialize wgmma without a C7510 warning (a wait after every HGMMA, seen when a
    # branch guarded the issue): each variant keeps its handful of batch waits.
    for kernel in sass.split("Function : ")[1:]:
        count, waits = kernel.count(gmma), kernel.count("WARPGROUP.DEPBAR")
        assert count == 0 or waits * per_wait < count, f"{kernel.split()[0]}: {waits} wgmma waits for {count} {gmma}"
