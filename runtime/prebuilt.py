"""Prebuilt modules: find a spec's library in a prebuilt package before looking in the cache.

A prebuilt package is a folder holding `prebuilt.json` and, per module, the folder the cache would
hold (`<uri>/<uri>.so` and `<uri>/src/binding.py`). Packages are the folders of
ATTNFORGE_PREBUILT_PATH (searched first, in order), then the packages of installed distributions that
register an entry point in the group `attnforge.prebuilt` (the wheels `attnforge package` writes).

Lookups are read-only: no lock, no write, no compiler. A package built by another attnforge version
is ignored with one log line. A module built with other build options (build.build_options: the
user's extra nvcc flags, a CUTLASS_DIR) than the reader's is not used. A library whose size or sha256 differs from its record is skipped with
one warning, and the module then comes from the cache like any other.

prebuilt.json (written by attnforge.package):
    {"format": 1, "attnforge_version": "0.1.0",
     "modules": {"<uri>": {"spec": {KernelSpec.to_dict()}, "source_hash": "<sha256 of templates>",
                           "build_options": ["<ATTNFORGE_EXTRA_CUDAFLAGS word>", "CUTLASS_DIR=<path>"],
                           "archs": ["90a"], "nvcc_version": "<last line of nvcc --version>",
                           "library": "<uri>/<uri>.so", "size": <bytes>, "sha256": "<hex>"}}}
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from attnforge.codegen.spec import KernelSpec

from . import integrity
from .build import build_options, version
from .settings import Settings, settings as read_settings

log = logging.getLogger("attnforge")

ENTRY_POINT_GROUP = "attnforge.prebuilt"
INDEX_NAME = "prebuilt.json"
FORMAT = 1


@dataclass(frozen=True)
class Record:
    """One module of a prebuilt package: where its library lies and what it must hash to."""

    library: Path
    size: int
    sha256: str
    options: tuple[str, ...]  # build.build_options at packaging (absent in a record: none)


def find(spec: KernelSpec, config: Settings | None = None) -> Path | None:
    """The verified library of `spec` in a prebuilt package, or None (then the cache serves it)."""
    config = config or read_settings()
    record = _index(package_roots(config)).get(spec.uri)
    if record is None or record.options != build_options(config) or not _verified(record):
        return None
    return record.library


def package_roots(config: Settings) -> tuple[Path, ...]:
    return (*config.prebuilt_path, *_entry_point_roots())


@functools.cache
def _entry_point_roots() -> tuple[Path, ...]:
    """The folders of installed prebuilt packages, located without importing them."""
    roots = []
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found = importlib.util.find_spec(entry.module)
        if found is None or not found.submodule_search_locations:
            log.warning("prebuilt entry point %r names %r, which is not an importable package; ignored",
                        entry.name, entry.module)
            continue
        roots.append(Path(found.submodule_search_locations[0]))
    return tuple(roots)


@functools.cache
def _index(roots: tuple[Path, ...]) -> dict[str, Record]:
    index: dict[str, Record] = {}
    for root in roots:
        for uri, record in _read_package(root).items():
            index.setdefault(uri, record)  # an earlier root wins
    return index


@functools.cache
def _read_package(root: Path) -> dict[str, Record]:
    """The records of one package; an unusable package logs why, once per process, and yields none."""
    path = root / INDEX_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        log.warning("prebuilt package %s has no %s (check ATTNFORGE_PREBUILT_PATH); ignored", root, INDEX_NAME)
        return {}
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s); prebuilt package ignored", path, exc)
        return {}
    built_by = data.get("attnforge_version") if isinstance(data, dict) else None
    if built_by != version():
        log.warning("ignoring prebuilt package %s: built by attnforge %s, this is attnforge %s "
                    "(rebuild it with `attnforge package`)", root, built_by, version())
        return {}
    try:
        return {uri: _record(root, entry) for uri, entry in data["modules"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        log.warning("%s is malformed (%s: %s); prebuilt package ignored", path, type(exc).__name__, exc)
        return {}


def _record(root: Path, entry: dict) -> Record:
    options = entry.get("build_options", [])
    if not (isinstance(options, list) and all(isinstance(word, str) for word in options)):
        raise TypeError(f"build_options must be a list of strings, got {options!r}")
    return Record(root / entry["library"], int(entry["size"]), str(entry["sha256"]), tuple(options))


def _verified(record: Record) -> bool:
    try:
        stat = record.library.stat()
    except OSError:
        return _check(record, None)
    return _check(record, (stat.st_size, stat.st_mtime_ns, stat.st_ino))


@functools.cache
def _check(record: Record, stat_key: tuple[int, int, int] | None) -> bool:
    """Size and sha256 against the record, once per file state, so a bad file warns once."""
    problem = integrity.mismatch(record.library, record.size, record.sha256)
    if problem is None and not (record.library.parent / "src" / "binding.py").is_file():
        problem = "it has no src/binding.py beside it"
    if problem:
        log.warning("prebuilt %s: %s; not loaded, using the cache instead", record.library, problem)
    return problem is None
