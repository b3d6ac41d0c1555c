"""Rendering: a valid spec becomes a folder of sources (the "describe" step; no compiler runs here).

One strict Jinja environment; same spec -> byte-identical files (sorted iteration, no timestamps).
A folder per uri holds the kernel translation units (one per kernel instantiation, so ninja builds
them in parallel), the C-ABI entry points, the generated Python binding and metadata.json.
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
from .fa3_units import INSTANCES, Instance, fa3_extended_wgmma, fa3_instances, fa3_kv_tile, fa3_tile_dim
from .kv_tiles import decode_tile, prefill_cta_tiles, prefill_kv_tile, prefill_vo_slices
from .rules import ensure_valid
from .sources import source_hash, templates_dir
from .spec import Backend, KernelSpec, Kind, PosEncoding

# Query heads per CTA the decode kernel is compiled for; any group size is served by tiling it.
DECODE_HEADS_PER_CTA = (1, 2, 4, 8)
METADATA = "metadata.json"


@dataclass(frozen=True)
class Variant:
    """One kernel launcher, rendered into its own translation unit `<name>.cu`, and the further
    instantiations it launches, each in a unit `<name>_<instance>.cu` of its own."""

    name: str
    template: str
    context: tuple[tuple[str, object], ...]
    instances: tuple[Instance, ...] = ()


@dataclass(frozen=True)
class ModuleLayout:
    """What a module of one kind holds: its C-ABI structs, entry-point template, the Python
    signatures of its entry points (role, ctypes argtypes, ctypes restype) and kernel variants."""

    params_struct: str
    structs: tuple[abi.Struct, ...]
    entry_template: str
    entry_points: tuple[tuple[str, str, str], ...]
    variants: tuple[Variant, ...]


def module_layout(spec: KernelSpec) -> ModuleLayout:
    if spec.kind is Kind.DECODE:
        return ModuleLayout(
            params_struct="DecodeParams",
            structs=abi.DECODE_STRUCTS,
            entry_template="decode_entry.cu.jinja",
            entry_points=(
                ("decode_plan", "[ctypes.POINTER(DecodePlanArgs), ctypes.POINTER(DecodePlanInfo)]", "ctypes.c_int32"),
                ("decode_upload", "[ctypes.POINTER(DecodePlanArgs)]", "ctypes.c_int32"),
                ("decode_occupancy", "[ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]", "ctypes.c_int32"),
                ("decode_run", "[ctypes.POINTER(DecodeParams), ctypes.c_void_p]", "ctypes.c_int32"),
            ),
            variants=tuple(Variant(f"decode_h{h}", "decode_variant.cu.jinja",
                                   (("heads", h), ("tile", decode_tile(spec, h))))
                           for h in DECODE_HEADS_PER_CTA),
        )
    return ModuleLayout(
        params_struct="PrefillParams",
        structs=abi.PREFILL_STRUCTS,
        entry_template="prefill_entry.cu.jinja",
        entry_points=(
            ("prefill_plan", "[ctypes.POINTER(PrefillPlanArgs), ctypes.POINTER(PrefillPlanInfo)]", "ctypes.c_int32"),
            ("prefill_occupancy", "[ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]",
             "ctypes.c_int32"),
            ("prefill_run", "[ctypes.POINTER(PrefillParams), ctypes.c_void_p]", "ctypes.c_int32"),
        ),
        variants=tuple(prefill_variant(spec, tile, paged)
                       for tile in prefill_cta_tiles(spec) for paged in (True, False)),
    )


def prefill_variant(spec: KernelSpec, tile: int, paged: bool) -> Variant:
    name = f"prefill_q{tile}_{'paged' if paged else 'ragged'}"
    context = (("tile", tile), ("paged", paged))
    if spec.backend is Backend.FA2:
        return Variant(name, "prefill_variant.cu.jinja", context + (("kv_tile", prefill_kv_tile(spec, tile, paged)),
                                                                    ("vo_slices", prefill_vo_slices(spec))))
    instances = fa3_instances(spec, paged)
    context += (("kv_tile", fa3_kv_tile(spec, paged)), ("extended_wgmma", fa3_extended_wgmma(spec, paged)),
                ("tile_dims", (fa3_tile_dim(spec, spec.head_dim_qk), fa3_tile_dim(spec, spec.head_dim_vo))),
                ("instance_flags", tuple((instance.flag, instance in instances) for instance in INSTANCES)))
    return Variant(name, "prefill_variant_fa3.cu.jinja", context, instances)


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


def template_context(spec: KernelSpec, layout: ModuleLayout) -> dict:
    uri = spec.uri
    return {
        "uri": uri,
        "symbol": uri,
        "kind": spec.kind.value,
        "dtype_q": spec.dtype_q.cpp,
        "dtype_kv": spec.dtype_kv.cpp,
        "dtype_o": spec.dtype_o.cpp,
        "head_dim_qk": spec.head_dim_qk,
        "head_dim_vo": spec.head_dim_vo,
        "use_soft_cap": spec.use_logits_soft_cap,
        "use_sliding_window": spec.use_sliding_window,
        "use_custom_mask": spec.use_custom_mask,
        "pos_encoding": list(PosEncoding).index(spec.pos_encoding),
        "structs": layout.structs,
        "params_struct": layout.params_struct,
        "entry_points": layout.entry_points,
        "variants": layout.variants,
        "plan_header": abi.PLAN_HEADER,
        "heads_per_cta": DECODE_HEADS_PER_CTA,
        "cta_tiles": prefill_cta_tiles(spec),
        "backend": spec.backend.value,
    }


def render(spec: KernelSpec) -> RenderedModule:
    """Render every file of the spec's module. Refuses (UnsupportedSpecError) an invalid spec
    before producing anything."""
    ensure_valid(spec)
    env = environment()
    layout = module_layout(spec)
    ctx = template_context(spec, layout)
    files = {
        "config.cuh": env.get_template("config.cuh.jinja").render(ctx),
        "entry.cu": env.get_template(layout.entry_template).render(ctx),
        "binding.py": env.get_template("binding.py.jinja").render(ctx),
    }
    for variant in layout.variants:
        files[f"{variant.name}.cu"] = env.get_template(variant.template).render(
            ctx, **dict(variant.context), variant_instances=variant.instances)
        for instance in variant.instances:
            files[f"{variant.name}_{instance.name}.cu"] = env.get_template("prefill_instance_fa3.cu.jinja").render(
                ctx, **dict(variant.context), instance=instance)
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


def stale(out_dir: Path, keep: set[str]) -> list[str]:
    """Module folders under out_dir (those holding our metadata.json) not named in keep."""
    folders = sorted(Path(out_dir).iterdir()) if Path(out_dir).is_dir() else []
    return [f.name for f in folders if f.is_dir() and (f / METADATA).is_file() and f.name not in keep]


def prune(out_dir: Path, keep: set[str]) -> list[str]:
    """Remove the stale module folders under out_dir; returns their names."""
    removed = stale(out_dir, keep)
    for name in removed:
        shutil.rmtree(Path(out_dir) / name)
    return removed
