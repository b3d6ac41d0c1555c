"""Build a module: render its sources into the cache, write build.ninja, run ninja (nvcc).

Cache layout, one folder per uri under cache_root(): $ATTNFORGE_CACHE_DIR/<attnforge version>/, or
<attnforge version>/options-<hash>/ when build options the uri does not cover are set (build_options):
    <uri>/src/            rendered sources (written only when different)
    <uri>/build.<pid>.*/  one build in progress: build.ninja, objects, the staged library. Each build
                          has its own folder, so a compiler orphaned by a killed build never writes
                          where the next build works; the next builder removes such folders.
    <uri>/build/          the last successful build's folder, kept for inspection
    <uri>/<uri>.so        the installed module: appears atomically (rename), so a killed build never
                          leaves a half-written library that a later process loads
    <uri>/<uri>.so.json   its size and sha256, checked before every dlopen (see integrity.py)
    <uri>.lock            flock held by builders across check -> build -> load; the OS drops it if the
                          holder dies. Loading a verified module takes no lock and writes nothing, so a
                          read-only cache of built modules works.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from attnforge.codegen.render import render, write_files
from attnforge.codegen.sources import include_dir
from attnforge.codegen.spec import Backend, KernelSpec

from . import integrity
from .settings import CACHE_DIR_ENV, Settings, settings as read_settings

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


class CacheError(BuildError):
    """The cache cannot hold a module that must be (re)built: it is not writable."""


@functools.cache
def version() -> str:
    try:
        return metadata.version("attnforge")
    except metadata.PackageNotFoundError:
        return "dev"


def build_options(config: Settings) -> tuple[str, ...]:
    """What changes a module's binary besides its uri (spec, sources, attnforge's own flags): the
    user's ATTNFORGE_EXTRA_CUDAFLAGS and a CUTLASS_DIR checkout (FA3's CuTe headers)."""
    cutlass = (f"CUTLASS_DIR={config.cutlass_dir.expanduser().absolute()}",) if config.cutlass_dir else ()
    return (*config.extra_cuda_flags, *cutlass)


def cache_root(config: Settings) -> Path:
    """The folder of this attnforge version's modules built with config's build options: modules
    built with other options live elsewhere, so neither loads as the other."""
    root = config.cache_dir / version()
    options = build_options(config)
    if not options:
        return root
    return root / f"options-{hashlib.sha256(chr(0).join(options).encode()).hexdigest()[:12]}"


def module_dir(spec: KernelSpec, config: Settings | None = None) -> Path:
    return cache_root(config or read_settings()) / spec.uri


def library_path(spec: KernelSpec, config: Settings | None = None) -> Path:
    return module_dir(spec, config) / f"{spec.uri}.so"


def lock_path(spec: KernelSpec, config: Settings) -> Path:
    return module_dir(spec, config).parent / f"{spec.uri}.lock"


def _cache_not_writable(spec: KernelSpec, config: Settings, problem: str, error: OSError) -> CacheError:
    where = (f"{CACHE_DIR_ENV}={config.cache_dir} is not writable" if config.cache_dir_from_env else
             f"the cache {config.cache_dir} is not writable (nor any default; see {CACHE_DIR_ENV})")
    if problem == integrity.MISSING:
        return CacheError(f"cannot build {spec.uri}: {where} ({error}); set {CACHE_DIR_ENV} to a writable folder")
    return CacheError(
        f"{library_path(spec, config)} cannot be used: {problem}; {where} ({error}), so it cannot be rebuilt. "
        f"Delete {module_dir(spec, config)} with write access (the next load rebuilds it), rebuild the cache "
        f"where it was made, or set {CACHE_DIR_ENV} to a writable folder")


@contextlib.contextmanager
def module_lock(spec: KernelSpec, config: Settings, problem: str = integrity.MISSING):
    """Exclusive flock on the module's lock file; logs when another process holds it, so a wait is
    never silent. `problem` (why a build is needed) goes into the error if the cache is read-only."""
    path = lock_path(spec, config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except OSError as error:
        raise _cache_not_writable(spec, config, problem, error) from None
    with handle:
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


def _no_newline(text: str) -> str:
    if "\n" in text:
        raise BuildError(f"{text!r} contains a newline, which build.ninja cannot express; use another path")
    return text


def ninja_path(path: Path | str) -> str:
    """A path as ninja's lexer reads it in a build statement: $, space and colon escaped."""
    return _no_newline(str(path)).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def ninja_command(args) -> str:
    """Arguments as /bin/sh words (ninja runs commands through the shell), then $-escaped for ninja."""
    return " ".join(shlex.quote(_no_newline(str(arg))) for arg in args).replace("$", "$$")


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
        f"nvcc = {ninja_command([config.nvcc])}",
        f"cuda_flags = {ninja_command(flags)}",
        f"link_flags = {ninja_command(LINK_FLAGS)}",
        "",
        # ninja shell-quotes $in and $out itself
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
    lines += [f"build {ninja_path(unit + '.o')}: nvcc {ninja_path(src / unit)}" for unit in units]
    objects = " ".join(ninja_path(unit + ".o") for unit in units)
    lines += ["", f"build {ninja_path(out_name)}: link {objects}", f"default {ninja_path(out_name)}", ""]
    return "\n".join(lines)


@functools.cache
def _ninja() -> str:
    """The ninja of the `ninja` dependency (1.13+, a jobserver client), else the one on the PATH."""
    try:
        import ninja  # the PyPI package ships the binary
    except ImportError:
        ninja = None
    if ninja is not None and (Path(ninja.BIN_DIR) / "ninja").is_file():
        return str(Path(ninja.BIN_DIR) / "ninja")
    found = shutil.which("ninja")
    if found is None:
        raise BuildError("ninja not found: pip install ninja")
    return found


@functools.cache
def ninja_joins_jobservers() -> bool:
    """Whether ninja takes its job slots from a GNU make jobserver in MAKEFLAGS (ninja 1.13 and later)."""
    try:
        text = subprocess.run([_ninja(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    numbers = [int(part) for part in text.strip().split(".")[:2] if part.isdigit()]
    return len(numbers) == 2 and tuple(numbers) >= (1, 13)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Resolved before any fork: the child may only make the call (no dlopen between fork and exec).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent(parent: int):
    """preexec_fn for ninja: SIGTERM when this process dies, even by SIGKILL. ninja forwards SIGTERM
    to its compilers' process groups, so no nvcc outlives a killed build."""

    def arm() -> None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm if _prctl is not None else None


def _stop(proc: subprocess.Popen) -> None:
    """Stop ninja and its compilers: SIGTERM (ninja forwards it), then SIGKILL to its group."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _run_ninja(build_dir: Path, config: Settings, jobserver: str | None = None) -> None:
    """jobserver: MAKEFLAGS naming a jobserver shared with other builds; ninja then takes its job
    slots from it (an explicit -j would make ninja ignore it)."""
    cmd = [_ninja(), "-C", str(build_dir)]
    env = None
    if jobserver is not None:
        env = {**os.environ, "MAKEFLAGS": jobserver}
    elif config.max_jobs:
        cmd += ["-j", str(config.max_jobs)]
    # Its own session: a terminal's Ctrl-C reaches Python, which stops the build (not half of it).
    proc = subprocess.Popen(cmd, stdout=None if config.verbose else subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_die_with_parent(os.getpid()), env=env)
    try:
        output = proc.communicate()[0] or ""
    except BaseException:
        _stop(proc)
        raise
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-60:])
        raise BuildError(f"ninja failed in {build_dir} (exit {proc.returncode}):\n{tail}")
    serialized = [line.strip() for line in output.splitlines() if SERIALIZED_WGMMA in line]
    if serialized:
        raise BuildError(f"ptxas serialized wgmma in {build_dir}; the kernel would run far below speed:\n" +
                         "\n".join(serialized[:10]))


def _remove_stale_builds(folder: Path) -> None:
    # The caller holds the lock, so every build.<pid>.* folder is from a builder that died.
    for stale in folder.glob("build.*"):
        log.debug("removing %s (left by a build that did not finish)", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _install(staged: Path, library: Path) -> None:
    """Move the library into place (atomic), then record its size and sha256 (atomic too): until the
    record exists the library counts as unverified and is rebuilt, never loaded."""
    os.replace(staged, library)
    integrity.write_record(library)


def _keep_as_last_build(build_dir: Path, folder: Path) -> None:
    last = folder / "build"
    shutil.rmtree(last, ignore_errors=True)
    os.replace(build_dir, last)


def build_locked(spec: KernelSpec, config: Settings, reason: str | None = None, jobserver: str | None = None) -> Path:
    """Build the module unless its installed library verifies; `reason` (a failed load) forces a
    rebuild. The caller holds the module's lock."""
    folder = module_dir(spec, config)
    library = folder / f"{spec.uri}.so"
    reason = reason or integrity.problem(library)
    if reason is None:
        return library
    started = time.perf_counter()
    if reason == integrity.MISSING:
        log.info("compiling %s (first use)", spec.uri)
    else:
        log.warning("%s: %s; rebuilding it", library, reason)
        log.info("compiling %s (rebuild)", spec.uri)
    src = write_files(render(spec), folder / "src")
    _remove_stale_builds(folder)
    build_dir = Path(tempfile.mkdtemp(prefix=f"build.{os.getpid()}.", dir=folder))
    staged = f"{spec.uri}.so.staged"
    (build_dir / "build.ninja").write_text(ninja_file(spec, src, staged, config))
    _run_ninja(build_dir, config, jobserver)
    _install(build_dir / staged, library)
    _keep_as_last_build(build_dir, folder)
    log.info("compiled %s in %.1f s", spec.uri, time.perf_counter() - started)
    return library


def build(spec: KernelSpec, config: Settings | None = None, jobserver: str | None = None) -> Path:
    """Build (once, across processes) and return the module's library path. jobserver: see _run_ninja."""
    config = config or read_settings()
    library = library_path(spec, config)
    problem = integrity.problem(library)
    if problem is None:
        return library
    with module_lock(spec, config, problem):
        return build_locked(spec, config, jobserver=jobserver)
