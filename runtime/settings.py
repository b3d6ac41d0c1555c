"""Every environment variable attnforge reads, declared once, typed."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from attnforge.codegen.spec import Arch


@dataclass(frozen=True)
class Settings:
    cache_dir: Path  # ATTNFORGE_CACHE_DIR: built modules, one folder per uri (default ~/.cache/attnforge)
    cuda_arch_list: tuple[Arch, ...] | None  # ATTNFORGE_CUDA_ARCH_LIST="8.0 9.0a": override the device's arch
    debug: bool  # ATTNFORGE_DEBUG=1: synchronize and check after every kernel, raise on kernel error bits
    verbose: bool  # ATTNFORGE_JIT_VERBOSE=1: stream the compiler's output
    max_jobs: int | None  # MAX_JOBS: parallel nvcc processes (about 1.5 GB each)
    nvcc: str | None  # ATTNFORGE_NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on the PATH
    extra_cuda_flags: tuple[str, ...]  # ATTNFORGE_EXTRA_CUDAFLAGS, appended to every nvcc command
    cutlass_dir: Path | None  # CUTLASS_DIR: a CUTLASS checkout whose include/ FA3 modules use (default: the wheel)
    prebuilt_path: tuple[Path, ...]  # ATTNFORGE_PREBUILT_PATH: folders holding prebuilt.json, searched before the cache


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


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


def settings() -> Settings:
    """Read the environment now (cheap; callers on hot paths keep the result)."""
    archs = os.environ.get("ATTNFORGE_CUDA_ARCH_LIST", "").split()
    jobs = os.environ.get("MAX_JOBS", "").strip()
    return Settings(
        cache_dir=Path(os.environ.get("ATTNFORGE_CACHE_DIR") or Path.home() / ".cache" / "attnforge"),
        cuda_arch_list=tuple(Arch.parse(a) for a in archs) or None,
        debug=_flag("ATTNFORGE_DEBUG"),
        verbose=_flag("ATTNFORGE_JIT_VERBOSE"),
        max_jobs=int(jobs) if jobs else None,
        nvcc=_find_nvcc(),
        extra_cuda_flags=tuple(os.environ.get("ATTNFORGE_EXTRA_CUDAFLAGS", "").split()),
        cutlass_dir=Path(os.environ["CUTLASS_DIR"]) if os.environ.get("CUTLASS_DIR") else None,
        prebuilt_path=tuple(Path(p) for p in os.environ.get("ATTNFORGE_PREBUILT_PATH", "").split(os.pathsep) if p),
    )
