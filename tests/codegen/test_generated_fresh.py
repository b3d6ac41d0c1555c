"""generated/ holds the default manifest's rendered output, committed; this test fails when it is stale."""

from __future__ import annotations

from pathlib import Path

from attnforge.codegen import manifest, render

GENERATED = Path(__file__).resolve().parents[2] / "generated"
FIX = "generated/ is stale: run `attnforge generate --prune` from the repository root and commit the result"


def _module_files(root: Path) -> dict[str, bytes]:
    """Files inside module folders (top-level files such as a README are not module output)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.glob("*/**/*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_matches_the_default_manifest(tmp_path):
    for spec in manifest.load(manifest.default_manifest_path()).specs:
        render.write(render.render(spec), tmp_path)
    expected, actual = _module_files(tmp_path), _module_files(GENERATED)
    missing, extra = sorted(expected.keys() - actual.keys()), sorted(actual.keys() - expected.keys())
    assert not missing and not extra, f"{FIX}\n  missing: {missing[:5]}\n  unexpected: {extra[:5]}"
    changed = sorted(name for name in expected if expected[name] != actual[name])
    assert not changed, f"{FIX}\n  changed: {changed[:5]}"
