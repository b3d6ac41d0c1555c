"""Manifests: TOML files naming sets of kernel specs.

    [defaults]                 # optional: values every group starts from
    archs = ["90a"]

    [[group]]
    name = "llama"             # optional label
    on_invalid = "skip"        # "skip" (default) drops combinations a rule refuses; "error" fails
    kind = "decode"
    backend = "fa2"
    dtype_q = ["bf16", "fp16"] # a list means: one spec per value (cartesian product)
    dtype_kv = "same_as_q"     # dtype_kv / dtype_o may follow the query's dtype
    dtype_o = "default"        # the query's dtype, bf16 for an fp8 query
    head_dim = [64, 128]       # shorthand for head_dim_qk = head_dim_vo
    archs = ["80", "90a"]      # one arch per spec; "80+90a" makes one module for both

Field names are KernelSpec's; values are its enum values or short names.
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .dtypes import DType, IndexType
from .rules import Rule, check
from .spec import Arch, Backend, KernelSpec, Kind, PosEncoding

SAME_AS_Q = "same_as_q"
DEFAULT_OUTPUT = "default"


def default_manifest_path() -> Path:
    return Path(__file__).with_name("default_manifest.toml")


@dataclass
class Expansion:
    specs: list[KernelSpec] = field(default_factory=list)
    refused: list[tuple[KernelSpec, list[Rule]]] = field(default_factory=list)


class ManifestError(ValueError):
    pass


def _strict(value, kind: type, expected: str):
    # TOML already types its values: a quoted "false" or 128.5 is a mistake, not a value to coerce.
    if type(value) is not kind:
        raise ValueError(f"expected {expected}, got {value!r}")
    return value


_PARSERS = {
    "kind": Kind,
    "backend": Backend,
    "dtype_q": DType.parse,
    "dtype_kv": DType.parse,
    "dtype_o": DType.parse,
    "idtype": IndexType.parse,
    "head_dim_qk": lambda v: _strict(v, int, "an integer"),
    "head_dim_vo": lambda v: _strict(v, int, "an integer"),
    "pos_encoding": lambda v: PosEncoding(str(v).upper()),
    "use_sliding_window": lambda v: _strict(v, bool, "true or false"),
    "use_logits_soft_cap": lambda v: _strict(v, bool, "true or false"),
    "use_custom_mask": lambda v: _strict(v, bool, "true or false"),
    "fp16_qk_reduction": lambda v: _strict(v, bool, "true or false"),
    "archs": lambda v: tuple(Arch.parse(a) for a in str(v).split("+")),
}
_META_KEYS = {"name", "on_invalid"}


def _values(key: str, raw) -> list:
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise ManifestError(f"field {key!r} has an empty list of values")
    return items


def _expand_head_dim(table: dict, where: str) -> dict:
    """Rewrite the `head_dim` shorthand of one table (defaults or a group) before tables merge."""
    table = dict(table)
    if "head_dim" in table:
        if "head_dim_qk" in table or "head_dim_vo" in table:
            raise ManifestError(f"{where}: give either head_dim or head_dim_qk/head_dim_vo, not both")
        table["head_dim_qk"] = table.pop("head_dim")
        table["head_dim_vo"] = SAME_AS_Q
    return table


def _expand_group(group: dict, where: str) -> Expansion:
    unknown = set(group) - set(_PARSERS) - _META_KEYS
    if unknown:
        raise ManifestError(f"{where}: unknown field(s) {sorted(unknown)}; expected some of {sorted(_PARSERS)}")
    on_invalid = group.get("on_invalid", "skip")
    if on_invalid not in ("skip", "error"):
        raise ManifestError(f"{where}: on_invalid must be 'skip' or 'error', got {on_invalid!r}")
    keys = sorted(k for k in group if k in _PARSERS)
    follow = {"dtype_kv": "dtype_q", "dtype_o": "dtype_q", "head_dim_vo": "head_dim_qk"}
    free = [k for k in keys if group[k] not in (SAME_AS_Q, DEFAULT_OUTPUT)]
    out = Expansion()
    for combo in itertools.product(*(_values(k, group[k]) for k in free)):
        raw = dict(zip(free, combo))
        for key, source in follow.items():
            if group.get(key) == SAME_AS_Q:
                raw[key] = raw[source]
        try:
            kwargs = {k: _PARSERS[k](v) for k, v in raw.items()}
            if group.get("dtype_o") == DEFAULT_OUTPUT:
                kwargs["dtype_o"] = kwargs["dtype_q"].default_output
            spec = KernelSpec(**kwargs)
        except (TypeError, ValueError, KeyError) as exc:
            raise ManifestError(f"{where}: {exc}") from exc
        violations = check(spec)
        if not violations:
            out.specs.append(spec)
        elif on_invalid == "error":
            lines = "; ".join(rule.render(spec) for rule in violations)
            raise ManifestError(f"{where}: {spec.name} is refused: {lines}")
        else:
            out.refused.append((spec, violations))
    return out


def expand(data: dict, source: str = "<manifest>") -> Expansion:
    defaults = data.get("defaults", {})
    groups = data.get("group")
    if not isinstance(groups, list) or not groups:
        raise ManifestError(f"{source}: a manifest needs at least one [[group]] table")
    total = Expansion()
    seen = set()
    for index, group in enumerate(groups):
        label = group.get("name", f"group {index}")
        where = f"{source}: {label}"
        merged = {**_expand_head_dim(defaults, f"{source}: defaults"), **_expand_head_dim(group, where)}
        part = _expand_group(merged, where)
        for spec in part.specs:
            if spec not in seen:
                seen.add(spec)
                total.specs.append(spec)
        total.refused.extend(part.refused)
    total.specs.sort(key=lambda s: s.name)
    return total


def load(path: Path) -> Expansion:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from exc
    return expand(data, str(path))
