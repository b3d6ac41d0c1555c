"""Integrity records of installed libraries: `<library>.json` holds the size and sha256 the library
had when it was installed, and `problem()` checks a library against it before anything maps it.

Checking before dlopen is what keeps a damaged cache from killing the interpreter: dlopen of a
truncated ELF maps pages past the end of the file and the first touch raises SIGBUS. The size is
compared first (a stat); the hash is computed once per process per file version (path, inode,
size, mtime), so a hit costs one read of the library per process.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MISSING = "it is missing"
_CHUNK = 1 << 20
# (path, inode, size, mtime_ns, sha256) of libraries whose bytes matched their record in this process.
_verified: set[tuple[str, int, int, int, str]] = set()


def record_path(library: Path) -> Path:
    return library.with_name(library.name + ".json")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_record(library: Path) -> None:
    """Record the installed library's size and sha256; atomic (written aside, then renamed)."""
    record = {"size": library.stat().st_size, "sha256": sha256(library)}
    target = record_path(library)
    staged = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    staged.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(staged, target)


def _read_record(library: Path) -> dict | str:
    try:
        record = json.loads(record_path(library).read_text())
    except FileNotFoundError:
        return f"it has no integrity record ({record_path(library).name})"
    except (OSError, ValueError) as error:
        return f"its integrity record {record_path(library).name} is unreadable ({error})"
    if not (isinstance(record, dict) and isinstance(record.get("size"), int) and
            isinstance(record.get("sha256"), str)):
        return f"its integrity record {record_path(library).name} is malformed"
    return record


def problem(library: Path) -> str | None:
    """What is wrong with `library` (missing, truncated, altered, unrecorded), or None if it is
    exactly the file that was installed."""
    if not library.is_file():
        return MISSING
    record = _read_record(library)
    if isinstance(record, str):
        return record
    return mismatch(library, record["size"], record["sha256"])


def mismatch(library: Path, size: int, digest: str) -> str | None:
    """How `library` differs from the size and sha256 it was recorded with, or None if it matches."""
    try:
        stat = library.stat()
    except (FileNotFoundError, NotADirectoryError):
        return MISSING
    key = (str(library), stat.st_ino, stat.st_size, stat.st_mtime_ns, digest)
    if key in _verified:
        return None
    if stat.st_size != size:
        kind = "empty" if stat.st_size == 0 else "truncated" if stat.st_size < size else "longer"
        return f"it is {kind}: {stat.st_size} bytes, {size} when recorded"
    if sha256(library) != digest:
        return "its sha256 differs from the one recorded (the file was altered)"
    _verified.add(key)
    return None
