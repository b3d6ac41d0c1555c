"""Load a built module: dlopen (RTLD_LOCAL), bind its C ABI through the generated binding, and
refuse it unless its struct layouts match the binding's ctypes mirror."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from attnforge.codegen.abi import expected_abi_table
from attnforge.codegen.render import module_layout
from attnforge.codegen.spec import KernelSpec

from . import prebuilt
from .build import build_locked, file_lock, lock_path, module_dir
from .settings import Settings, settings as read_settings


class ModuleLoadError(RuntimeError):
    pass


@dataclass(frozen=True, eq=False)
class Module:
    """A loaded kernel module: its spec, the ctypes struct types and the bound entry points."""

    spec: KernelSpec
    path: Path
    binding: ModuleType
    fns: dict

    def last_error(self) -> str:
        return self.fns["last_error"]().decode(errors="replace")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed (code {status}): {self.last_error()}")


def import_binding(path: Path, uri: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"attnforge_binding_{uri}", path)
    if spec is None or spec.loader is None:
        raise ModuleLoadError(f"cannot import the generated binding {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_layout(spec: KernelSpec, binding: ModuleType, fns: dict, library: Path) -> None:
    """Compare the module's sizeof/offsetof table with the ctypes mirror, field by field."""
    expected = expected_abi_table(binding.STRUCTS, module_layout(spec).structs)
    buffer = (ctypes.c_int64 * (len(expected) + 8))()
    count = fns["abi"](buffer, len(buffer))
    reported = list(buffer[: min(count, len(buffer))])
    if reported != expected:
        raise ModuleLoadError(
            f"{library}: the module's struct layout does not match its binding "
            f"(module reports {reported}, binding expects {expected}); delete {library.parent} to rebuild"
        )


def open_library(spec: KernelSpec, library: Path) -> Module:
    binding = import_binding(library.parent / "src" / "binding.py", spec.uri)
    if binding.URI != spec.uri:
        raise ModuleLoadError(f"{library}: binding is for {binding.URI}, expected {spec.uri}")
    lib = ctypes.CDLL(str(library), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    fns = binding.bind(lib)
    check_layout(spec, binding, fns, library)
    return Module(spec=spec, path=library, binding=binding, fns=fns)


def load_uncached(spec: KernelSpec, config: Settings | None = None) -> Module:
    """Load from a prebuilt package if one holds the module (no lock, no compiler); else build if
    needed and load, holding the module's lock across check, build and load."""
    config = config or read_settings()
    found = prebuilt.find(spec, config)
    if found is not None:
        return open_library(spec, found)
    with file_lock(lock_path(spec, config)):
        library = build_locked(spec, config)
        return open_library(spec, library)


@functools.cache
def _load_cached(spec: KernelSpec, cache_dir: Path) -> Module:
    return load_uncached(spec)


def load(spec: KernelSpec) -> Module:
    """The module for `spec`, built on first use and loaded once per process (per cache dir)."""
    return _load_cached(spec, module_dir(spec).parent)
