"""Build a module: render its sources into the cache, write build.ninja, run ninja (nvcc).

Cache layout, one folder per uri under $ATTNFORGE_CACHE_DIR/<attnforge version>/:
    <uri>/src/         rendered sources (written only when different, so ninja rebuilds little)
    <uri>/build/       build.ninja, objects, the linked library before it is installed
    <uri>/<uri>.so     the installed module: appears atomically (rename), so a killed build never
                       leaves a half-written library that a later process loads
    <uri>.lock         flock held across check -> build -> load; the OS drops it if the holder dies
"""

from __future__ import annotations

import contextlib
import functools
import fcntl
import logging
import os
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path

from attnforge.codegen.render import render, write_files
from attnforge.codegen.sources import include_dir
from attnforge.codegen.spec import Backend, KernelSpec

from .settings import Settings, settings as read_settings

log = logging.getLogger("attnforge")

# -O3 and NDEBUG matter for speed; static cudart keeps the module free of any runtime library
# version beyond the driver; hidden visibility exports only the extern "C" entry points.
NVCC_FLAGS = (
    "-O3",
    "-std=c++17",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC,-fvisibility=hidden",
)
LINK_FLAGS = ("-shared", "-cudart=static", "-lrt", "-ldl", "-lpthread")
# FA3 kernels are written with CuTe (its include dir is added per build); the units whose tiles need
# CuTe's extended wgmma shapes define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED themselves, since those
# headers cost most of a unit's compile time (codegen/fa3_units.py).
# ptxas -v: some reports of serialized wgmma (C7520, a dependence in a divergent path) come only as
# info lines, and the build output is scanned for them.
FA3_FLAGS = ("-Xptxas=-v",)
# ptxas "wgmma.mma_async instructions are serialized" (C7510 as a warning, C7520 and C7512 as info,
# and whatever code comes next): the module would run several times slower than it should (a C7520
# build ran at 37 instead of 600 TFLOP/s; fp8 hd 256 serialized for want of registers, C7512, ran
# 14-17% slower), so the build fails instead.
SERIALIZED_WGMMA = "wgmma.mma_async instructions are serialized"


class BuildError(RuntimeError):
    pass


@functools.cache
def version() -> str:
    try:
        return metadata.version("attnforge")
    except metadata.PackageNotFoundError:
        return "dev"


def module_dir(spec: KernelSpec, config: Settings | None = None) -> Path:
    config = config or read_settings()
    return config.cache_dir / version() / spec.uri


def library_path(spec: KernelSpec, config: Settings | None = None) -> Path:
    return module_dir(spec, config) / f"{spec.uri}.so"


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive flock on `path`; logs when another process holds it, so a wait is never silent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for %s (another process is building this module)", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cutlass_include(config: Settings) -> Path:
    """CuTe/CUTLASS headers: $CUTLASS_DIR/include, else those of the nvidia-cutlass wheel."""
    if config.cutlass_dir is not None:
        path = config.cutlass_dir / "include"
    else:
        try:
            import cutlass_library
        except ImportError:
            raise BuildError("fa3 modules need the CUTLASS headers: pip install nvidia-cutlass, or set CUTLASS_DIR "
                             "to a CUTLASS checkout") from None
        path = Path(cutlass_library.__file__).parent / "source" / "include"
    if not (path / "cute" / "tensor.hpp").is_file():
        raise BuildError(f"no CuTe headers at {path} (expected cute/tensor.hpp); check CUTLASS_DIR or nvidia-cutlass")
    return path


def ninja_file(spec: KernelSpec, src: Path, out_name: str, config: Settings) -> str:
    if config.nvcc is None:
        raise BuildError("nvcc not found: set CUDA_HOME or ATTNFORGE_NVCC, or put nvcc on the PATH")
    flags = [*NVCC_FLAGS, *(a.gencode for a in spec.archs), f"-I{src}", f"-I{include_dir()}"]
    if spec.backend is Backend.FA3:
        flags += [*FA3_FLAGS, f"-I{cutlass_include(config)}"]
    flags += config.extra_cuda_flags
    units = sorted(p.name for p in src.glob("*.cu"))
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {config.nvcc}",
        f"cuda_flags = {' '.join(flags)}",
        f"link_flags = {' '.join(LINK_FLAGS)}",
        "",
        "rule nvcc",
        "  command = $nvcc $cuda_flags -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $in",
        "",
        "rule link",
        "  command = $nvcc $in $link_flags -o $out",
        "  description = link $out",
        "",
    ]
    lines += [f"build {unit}.o: nvcc {src / unit}" for unit in units]
    lines += ["", f"build {out_name}: link {' '.join(unit + '.o' for unit in units)}", f"default {out_name}", ""]
    return "\n".join(lines)


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    import ninja  # the PyPI package ships the binary

    return str(Path(ninja.BIN_DIR) / "ninja")


def _run_ninja(build_dir: Path, config: Settings) -> None:
    cmd = [_ninja(), "-C", str(build_dir)]
    if config.max_jobs:
        cmd += ["-j", str(config.max_jobs)]
    if config.verbose:
        result = subprocess.run(cmd)
        output = ""
    else:
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = result.stdout
    if result.returncode != 0:
        tail = "\n".join(output.splitlines()[-60:])
        raise BuildError(f"ninja failed in {build_dir} (exit {result.returncode}):\n{tail}")
    serialized = [line.strip() for line in output.splitlines() if SERIALIZED_WGMMA in line]
    if serialized:
        raise BuildError(f"ptxas serialized wgmma in {build_dir}; the kernel would run far below speed:\n" +
                         "\n".join(serialized[:10]))


def build_locked(spec: KernelSpec, config: Settings) -> Path:
    """Build the module if its library is missing. The caller holds the module's lock."""
    folder = module_dir(spec, config)
    library = folder / f"{spec.uri}.so"
    if library.exists():
        return library
    started = time.perf_counter()
    log.info("compiling %s (first use)", spec.uri)
    src = write_files(render(spec), folder / "src")
    build_dir = folder / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    staged = f"{spec.uri}.so.staged"
    (build_dir / "build.ninja").write_text(ninja_file(spec, src, staged, config))
    _run_ninja(build_dir, config)
    os.replace(build_dir / staged, library)
    log.info("compiled %s in %.1f s", spec.uri, time.perf_counter() - started)
    return library


def lock_path(spec: KernelSpec, config: Settings) -> Path:
    return module_dir(spec, config).parent / f"{spec.uri}.lock"


def build(spec: KernelSpec, config: Settings | None = None) -> Path:
    """Build (once, across processes) and return the module's library path."""
    config = config or read_settings()
    with file_lock(lock_path(spec, config)):
        return build_locked(spec, config)
