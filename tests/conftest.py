"""Shared test setup: GPU tests carry @pytest.mark.gpu and skip cleanly without a CUDA device;
tests that compile carry @pytest.mark.nvcc and skip without nvcc. `tiny_build` compiles one small
module once per session for the tests that need a built module; `sass_of` disassembles one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import pytest


def _cuda_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    return True, ""


def pytest_collection_modifyitems(config, items):
    has_gpu, why = _cuda_available()
    has_nvcc = shutil.which("nvcc") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {why}"))
        if "nvcc" in item.keywords and not has_nvcc:
            item.add_marker(pytest.mark.skip(reason="needs nvcc on the PATH"))


# One module (fa2 decode, bf16, head dim 128, sm80): the smallest build, shared by the build and
# prebuilt-package tests.
TINY_MANIFEST = """\
[[group]]
kind = "decode"
backend = "fa2"
dtype_q = "bf16"
dtype_kv = "same_as_q"
dtype_o = "default"
head_dim = 128
archs = "80"
"""


@dataclass(frozen=True)
class TinyBuild:
    """The first `attnforge build` of the tiny manifest into a fresh cache: its files and its result."""

    manifest: Path
    cache: Path
    spec: object  # the manifest's one KernelSpec
    result: subprocess.CompletedProcess

    @property
    def library(self) -> Path:
        """Where the build put the module's library."""
        from attnforge.build import library_path
        from attnforge.settings import settings

        return library_path(self.spec, replace(settings(), cache_dir=self.cache))


@pytest.fixture(scope="session")
def module_cache(tmp_path_factory) -> Path:
    """One module cache for the whole run, shared by the tests that only need modules built and
    loaded (the layout and first-use tests, the head-dim compile tests, the planner's module): each
    distinct module compiles once per run. Tests that damage, lock or fail builds use their own."""
    return tmp_path_factory.mktemp("module_cache")


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory) -> TinyBuild:
    """`attnforge build` of the tiny manifest, run once per session (it compiles); tests reuse its cache."""
    from attnforge.codegen import manifest

    root = tmp_path_factory.mktemp("tiny_build")
    path = root / "tiny.toml"
    path.write_text(TINY_MANIFEST)
    cache = root / "cache"
    result = subprocess.run([sys.executable, "-m", "attnforge.codegen.cli", "build", "--manifest", str(path),
                             "--cache-dir", str(cache)], capture_output=True, text=True, timeout=1800)
    (spec,) = manifest.load(path).specs
    return TinyBuild(manifest=path, cache=cache, spec=spec, result=result)


def _cuda_tool(name: str, wheel: str) -> str | None:
    """A CUDA binary tool from the CUDA install, else from its nvidia-cuda-* wheel (test extras)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        files = metadata.files(wheel) or []
    except metadata.PackageNotFoundError:
        return None
    return next((str(Path(f.locate())) for f in files if f.name == name), None)


@pytest.fixture(scope="session")
def sass_of():
    """sass_of(library) -> `cuobjdump -sass` text of a built module; skips without the tools."""
    cuobjdump = _cuda_tool("cuobjdump", "nvidia-cuda-cuobjdump")
    nvdisasm = _cuda_tool("nvdisasm", "nvidia-cuda-nvdisasm")  # cuobjdump -sass runs it
    if cuobjdump is None or nvdisasm is None:
        pytest.skip("no cuobjdump/nvdisasm (install the test extras nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")
    env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def disassemble(library) -> str:
        done = subprocess.run([cuobjdump, "-sass", str(library)], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    return disassemble

