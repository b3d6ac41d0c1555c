"""Load a built module: check its bytes against the integrity record, dlopen (RTLD_LOCAL), bind its
C ABI through the generated binding, and refuse it unless its struct layouts match the binding's
ctypes mirror. A module that verifies loads without a lock and without writing; one that is missing,
damaged or fails to dlopen is (re)built under the module's lock."""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from attnforge.codegen.abi import expected_abi_table
from attnforge.codegen.render import module_layout
from attnforge.codegen.spec import KernelSpec

from . import integrity, prebuilt
from .build import build_locked, library_path, module_dir, module_lock
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


class _NoBytecodeLoader(importlib.machinery.SourceFileLoader):
    """Writes no __pycache__ next to the binding: a cache hit must not write into the cache."""

    def set_data(self, path, data, *, _mode=0o666):
        pass


def import_binding(path: Path, uri: str) -> ModuleType:
    name = f"attnforge_binding_{uri}"
    spec = importlib.util.spec_from_file_location(name, path, loader=_NoBytecodeLoader(name, str(path)))
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


def _open_verified(spec: KernelSpec, library: Path) -> Module | str:
    """The module, or what is wrong with its library (checked before dlopen can map a bad file)."""
    problem = integrity.problem(library)
    if problem is not None:
        return problem
    try:
        return open_library(spec, library)
    except OSError as error:
        return f"it does not load ({error})"


def load_uncached(spec: KernelSpec, config: Settings | None = None) -> Module:
    """Load from a prebuilt package if one holds the module (no lock, no compiler); else from the
    cache if it verifies; otherwise, holding its lock, check again, (re)build and load."""
    config = config or read_settings()
    found = prebuilt.find(spec, config)
    if found is not None:
        return open_library(spec, found)
    library = library_path(spec, config)
    found = _open_verified(spec, library)
    if isinstance(found, Module):
        return found
    with module_lock(spec, config, found):
        found = _open_verified(spec, library)  # another process may have built it while we waited
        if isinstance(found, Module):
            return found
        return open_library(spec, build_locked(spec, config, reason=found))


@functools.cache
def _load_cached(spec: KernelSpec, cache_dir: Path) -> Module:
    return load_uncached(spec)


def load(spec: KernelSpec) -> Module:
    """The module for `spec`, built on first use and loaded once per process (per cache dir)."""
    return _load_cached(spec, module_dir(spec).parent)
