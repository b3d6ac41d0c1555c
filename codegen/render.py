"""Rendering: a valid spec becomes a folder of sources (the "describe" step; no compiler runs here).

One strict Jinja environment; same spec -> byte-identical files (sorted iteration, no timestamps).
A folder per uri holds the kernel translation units (one per compiled variant, so ninja builds them
in parallel), the C-ABI entry points, the generated Python binding and metadata.json.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import jinja2

from . import abi
from .rules import ensure_valid
from .sources import source_hash, templates_dir
from .spec import KernelSpec

# Query heads per CTA the decode kernel is compiled for; any group size is served by tiling it.
DECODE_HEADS_PER_CTA = (1, 2, 4, 8)
METADATA = "metadata.json"


@dataclass(frozen=True)
class RenderedModule:
    spec: KernelSpec
    uri: str
    files: dict[str, str]

    @property
    def translation_units(self) -> list[str]:
        return sorted(name for name in self.files if name.endswith(".cu"))


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def template_context(spec: KernelSpec) -> dict:
    uri = spec.uri
    return {
        "uri": uri,
        "symbol": uri,
        "dtype_q": spec.dtype_q.cpp,
        "dtype_kv": spec.dtype_kv.cpp,
        "dtype_o": spec.dtype_o.cpp,
        "head_dim": spec.head_dim_qk,
        "use_soft_cap": spec.use_logits_soft_cap,
        "use_sliding_window": spec.use_sliding_window,
        "structs": abi.STRUCTS,
        "plan_header": abi.PLAN_HEADER,
        "heads_per_cta": DECODE_HEADS_PER_CTA,
    }


def render(spec: KernelSpec) -> RenderedModule:
    """Render every file of the spec's module. Refuses (UnsupportedSpecError) an invalid spec
    before producing anything."""
    ensure_valid(spec)
    env = environment()
    ctx = template_context(spec)
    files = {
        "config.cuh": env.get_template("config.cuh.jinja").render(ctx),
        "entry.cu": env.get_template("decode_entry.cu.jinja").render(ctx),
        "binding.py": env.get_template("binding.py.jinja").render(ctx),
    }
    for heads in DECODE_HEADS_PER_CTA:
        files[f"decode_h{heads}.cu"] = env.get_template("decode_variant.cu.jinja").render(ctx, heads=heads)
    files[METADATA] = _metadata(spec, ctx["uri"], files)
    return RenderedModule(spec=spec, uri=ctx["uri"], files=dict(sorted(files.items())))


def _metadata(spec: KernelSpec, uri: str, files: dict[str, str]) -> str:
    body = {
        "uri": uri,
        "spec": spec.to_dict(),
        "source_hash": source_hash(),
        "files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(files.items())},
    }
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def write(module: RenderedModule, out_dir: Path) -> Path:
    """Write the module into out_dir/<uri>/."""
    return write_files(module, Path(out_dir) / module.uri)


def write_files(module: RenderedModule, folder: Path) -> Path:
    """Write the module's files into `folder`, leaving unchanged files untouched (so ninja does not
    rebuild them) and removing files the module no longer has."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in module.files.items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)
    for path in folder.iterdir():
        if path.is_file() and path.name not in module.files:
            path.unlink()
    return folder


def prune(out_dir: Path, keep: set[str]) -> list[str]:
    """Remove module folders under out_dir (those holding our metadata.json) not named in keep."""
    removed = []
    for folder in sorted(Path(out_dir).iterdir()) if Path(out_dir).is_dir() else []:
        if folder.is_dir() and (folder / METADATA).is_file() and folder.name not in keep:
            shutil.rmtree(folder)
            removed.append(folder.name)
    return removed
