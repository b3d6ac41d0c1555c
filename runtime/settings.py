"""Every environment variable attnforge reads, declared once, typed.

A bad value raises `SettingsError` naming the variable, the value given and the values accepted;
`ATTNFORGE_LOG_LEVEL` alone only warns (it is read while `import attnforge` runs, which must not fail).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from attnforge.codegen.spec import Arch

log = logging.getLogger("attnforge")

CACHE_DIR_ENV = "ATTNFORGE_CACHE_DIR"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    cache_dir: Path  # ATTNFORGE_CACHE_DIR, else the first writable default (see default_cache_dirs)
    cache_dir_from_env: bool  # whether cache_dir came from ATTNFORGE_CACHE_DIR (errors then name it)
    cuda_arch_list: tuple[Arch, ...] | None  # ATTNFORGE_CUDA_ARCH_LIST="8.0 9.0a": override the device's arch
    # ATTNFORGE_DEBUG=1: synchronize and check after every kernel, raise on kernel error bits (while a
    # CUDA graph captures, the launch only: the kernels run at replay)
    debug: bool
    verbose: bool  # ATTNFORGE_JIT_VERBOSE=1: stream the compiler's output
    max_jobs: int | None  # MAX_JOBS: parallel nvcc processes (about 1.5 GB each)
    nvcc: str | None  # ATTNFORGE_NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on the PATH
    extra_cuda_flags: tuple[str, ...]  # ATTNFORGE_EXTRA_CUDAFLAGS, appended to every nvcc command
    cutlass_dir: Path | None  # CUTLASS_DIR: a CUTLASS checkout whose include/ FA3 modules use (default: the wheel)
    prebuilt_path: tuple[Path, ...]  # ATTNFORGE_PREBUILT_PATH: folders holding prebuilt.json, searched before the cache


def _flag(name: str) -> bool:
    value = os.environ.get(name, "")
    normalized = value.strip().lower()
    if normalized in _TRUE:
        return True
    if normalized in _FALSE:
        return False
    raise SettingsError(f"{name}={value!r} is not a boolean; expected one of {', '.join(_TRUE + _FALSE[1:])} "
                        f"(or unset)")


def _max_jobs() -> int | None:
    value = os.environ.get("MAX_JOBS", "")
    if not value.strip():
        return None
    try:
        jobs = int(value)
    except ValueError:
        jobs = 0
    if jobs <= 0:
        raise SettingsError(f"MAX_JOBS={value!r} is not a positive integer (the number of parallel nvcc "
                            f"processes, e.g. MAX_JOBS=4)")
    return jobs


def _arch_list() -> tuple[Arch, ...] | None:
    value = os.environ.get("ATTNFORGE_CUDA_ARCH_LIST", "")
    try:
        return tuple(Arch.parse(a) for a in value.replace(";", " ").split()) or None
    except ValueError as error:
        raise SettingsError(f"ATTNFORGE_CUDA_ARCH_LIST={value!r}: {error} (separate archs with spaces, "
                            f"e.g. \"8.0 9.0a\")") from None


def _find_nvcc() -> str | None:
    explicit = os.environ.get("ATTNFORGE_NVCC")
    if explicit:
        return explicit
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and Path(home, "bin", "nvcc").is_file():
            return str(Path(home, "bin", "nvcc"))
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def default_cache_dirs() -> tuple[Path, ...]:
    """Where the cache goes without ATTNFORGE_CACHE_DIR, in order of preference."""
    candidates = []
    try:
        candidates.append(Path.home() / ".cache" / "attnforge")
    except RuntimeError:  # no HOME and no passwd entry
        pass
    if os.environ.get("XDG_CACHE_HOME"):
        candidates.append(Path(os.environ["XDG_CACHE_HOME"]) / "attnforge")
    candidates.append(Path(tempfile.gettempdir()) / f"attnforge-{os.getuid()}")
    return tuple(candidates)


def writable(path: Path) -> bool:
    """Whether `path` is, or could be created as, a folder this process may write in."""
    for folder in (path, *path.parents):
        if folder.exists():
            return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
    return False


def _usable_default(path: Path) -> bool:
    # A default folder someone else owns (another user's /tmp/attnforge-<uid>) could hold planted modules.
    return writable(path) and (not path.exists() or path.stat().st_uid == os.getuid())


@functools.cache
def _first_writable(candidates: tuple[Path, ...]) -> Path:
    # Cached per candidate list so the fallback is checked, and logged, once per process.
    for path in candidates:
        if _usable_default(path):
            if path != candidates[0]:
                log.info("%s is not writable; caching built modules in %s (set %s to choose)",
                         candidates[0], path, CACHE_DIR_ENV)
            return path
    # None writable: keep the first; a build then fails naming ATTNFORGE_CACHE_DIR.
    return candidates[0]


def log_level() -> int:
    """ATTNFORGE_LOG_LEVEL as a logging level; a bad value warns once and means INFO."""
    value = os.environ.get("ATTNFORGE_LOG_LEVEL", "")
    name = value.strip().upper() or "INFO"
    if name in LOG_LEVELS:
        return getattr(logging, name)
    log.warning("ATTNFORGE_LOG_LEVEL=%r is not a log level; expected one of %s; using INFO",
                value, ", ".join(LOG_LEVELS))
    return logging.INFO


def settings() -> Settings:
    """Read the environment now (cheap; callers on hot paths keep the result)."""
    explicit = os.environ.get(CACHE_DIR_ENV, "")
    return Settings(
        # absolute: builds run ninja in a folder of their own, where a relative path means something else
        cache_dir=Path(explicit).expanduser().absolute() if explicit else _first_writable(default_cache_dirs()),
        cache_dir_from_env=bool(explicit),
        cuda_arch_list=_arch_list(),
        debug=_flag("ATTNFORGE_DEBUG"),
        verbose=_flag("ATTNFORGE_JIT_VERBOSE"),
        max_jobs=_max_jobs(),
        nvcc=_find_nvcc(),
        extra_cuda_flags=tuple(os.environ.get("ATTNFORGE_EXTRA_CUDAFLAGS", "").split()),
        cutlass_dir=Path(os.environ["CUTLASS_DIR"]) if os.environ.get("CUTLASS_DIR") else None,
        prebuilt_path=tuple(Path(p) for p in os.environ.get("ATTNFORGE_PREBUILT_PATH", "").split(os.pathsep) if p),
    )
