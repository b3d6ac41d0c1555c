"""Where the templates and kernel headers live, and the hash of their contents."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


def templates_dir() -> Path:
    """The package's templates folder (works for editable and regular installs)."""
    from attnforge import templates

    return Path(templates.__file__).parent


def include_dir() -> Path:
    return templates_dir() / "include"


@functools.cache
def source_hash() -> str:
    """sha256 over every template and header (path and bytes), in sorted order."""
    root = templates_dir()
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".jinja", ".cuh", ".h")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()
