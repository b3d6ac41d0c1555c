"""The source hash in every uri covers the renderer's Python: render.py's codegen imports, followed
through, stay within sources.RENDERERS (a module outside it could change the rendered sources
without changing any uri, and a stale module would load)."""

from __future__ import annotations

import ast
from pathlib import Path

from attnforge.codegen import sources

CODEGEN = Path(sources.__file__).parent


def codegen_imports(name: str) -> set[str]:
    """The codegen modules (file names) that codegen/<name> imports."""
    found = set()
    for node in ast.walk(ast.parse((CODEGEN / name).read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:  # from .x import y, or from . import x
                found |= {f"{module}.py"} if module else {f"{alias.name}.py" for alias in node.names}
            elif module.startswith("attnforge.codegen."):
                found.add(module.removeprefix("attnforge.codegen.").split(".")[0] + ".py")
    return {f for f in found if (CODEGEN / f).is_file()}


def test_renderers_are_what_render_imports():
    seen, todo = set(), ["render.py"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(codegen_imports(name))
    assert seen - {"sources.py"} <= set(sources.RENDERERS), sorted(seen - set(sources.RENDERERS))


def test_every_renderer_exists():
    assert all((CODEGEN / name).is_file() for name in sources.RENDERERS)
