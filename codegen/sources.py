"""Where the templates and kernel headers live, and the hash of what a module is made from."""

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


# The codegen modules render.py runs (the rest parse manifests, list specs or drive the CLI);
# tests/codegen/test_sources.py checks that render.py imports no other codegen module.
RENDERERS = ("abi.py", "dtypes.py", "fa3_units.py", "kv_tiles.py", "render.py", "rules.py", "spec.py")


@functools.cache
def source_hash() -> str:
    """sha256 over what a module's binary is made from besides its spec: every template and header
    (path and bytes, sorted), the renderer's Python (RENDERERS) and the compiler and linker flags.
    In every uri, so an edit to any of them names new modules and nothing stale loads."""
    from attnforge import build  # the runtime's compile flags (imported here: build imports codegen)

    root = templates_dir()
    files = [(p.relative_to(root).as_posix(), p) for p in root.rglob("*")
             if p.is_file() and p.suffix in (".jinja", ".cuh", ".h")]
    here = Path(__file__).parent
    files += [(f"codegen/{name}", here / name) for name in RENDERERS]
    digest = hashlib.sha256()
    for name, path in sorted(files):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    digest.update(" ".join((*build.NVCC_FLAGS, *build.FA3_FLAGS, *build.LINK_FLAGS)).encode())
    return digest.hexdigest()
