"""Manifests: TOML files naming sets of kernel specs.

    [defaults]                 # optional: values every group starts from
    archs = ["90a"]

    [[group]]
    name = "llama"             # optional label
    on_invalid = "skip"        # "skip" (default) drops combinations a rule refuses; "error" fails
    kind = "decode"
    backend = "fa2"
    dtype_q = ["bf16", "fp16"] # a list means: one spec per value (cartesian product)
    dtype_kv = "same_as_q"     # the default: the query's dtype (or a dtype, or a list of them)
    dtype_o = "default"        # the default: the query's dtype, bf16 for an fp8 query
    head_dim = [64, 128]       # shorthand for head_dim_qk = head_dim_vo
    archs = ["80", "90a"]      # one arch per spec; "80+90a" makes one module for both

Field names are KernelSpec's; values are its enum values or short names. kind, backend, dtype_q and
head_dim (or head_dim_qk) are required, in the group or in [defaults].

Every malformed input is a ManifestError of one line naming the field's path, e.g.
`m.toml: group[2].head_dim: expected a positive int, got "128"` (groups count from 0); a manifest
that yields no module is one too.
"""

from __future__ import annotations

import difflib
import itertools
import json
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


def _key(key: str) -> str:
    """A table key as TOML writes it: bare when it can be, else quoted (so the message stays one line)."""
    return key if key and all(c.isalnum() or c in "_-" for c in key) and key.isascii() else json.dumps(key)


def _show(value) -> str:
    """A value as it reads in TOML: "128" (a string), 128, true, [64, "x"], a table."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "a table {" + ", ".join(f"{_key(k)} = {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _choice(cls, what: str, normalize=str.lower, hints: dict | None = None):
    def parse(value):
        text = _string(value)
        for member in cls:
            if member.value == normalize(text):
                return member
        hint = (hints or {}).get(text.lower(), "")
        raise ValueError(f"unknown {what} {_show(text)}; expected one of {', '.join(m.value for m in cls)}{hint}")

    return parse


def _string(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_show(value)}")
    return value


def _positive_int(value) -> int:
    # TOML already types its values: a quoted "128" or 128.0 is a mistake, not a value to coerce.
    if type(value) is not int or value <= 0:
        raise ValueError(f"expected a positive int, got {_show(value)}")
    return value


def _flag(value) -> bool:
    if type(value) is not bool:
        raise ValueError(f"expected true or false, got {_show(value)}")
    return value


def _archs(value) -> tuple[Arch, ...]:
    if not isinstance(value, str):
        raise ValueError(f"expected an arch string such as \"90a\" or \"80+90a\", got {_show(value)}")
    return tuple(Arch.parse(a) for a in value.split("+"))


# One parser per spec field; each takes one TOML value (a list of them means a cartesian product).
_PARSERS = {
    "kind": _choice(Kind, "kind"),
    "backend": _choice(Backend, "backend",
                       hints={"auto": " ('auto' is the wrappers' run-time choice; a module names one backend)"}),
    "dtype_q": lambda v: DType.parse(_string(v)),
    "dtype_kv": lambda v: DType.parse(_string(v)),
    "dtype_o": lambda v: DType.parse(_string(v)),
    "idtype": lambda v: IndexType.parse(_string(v)),
    "head_dim_qk": _positive_int,
    "head_dim_vo": _positive_int,
    "pos_encoding": _choice(PosEncoding, "pos_encoding", normalize=str.upper),
    "use_sliding_window": _flag,
    "use_logits_soft_cap": _flag,
    "use_custom_mask": _flag,
    "archs": _archs,
}
# Values that follow another field instead of naming one; allowed only as the field's whole value.
_FOLLOW = {"dtype_kv": ("dtype_q", {SAME_AS_Q}), "dtype_o": ("dtype_q", {SAME_AS_Q, DEFAULT_OUTPUT}),
           "head_dim_vo": ("head_dim_qk", {SAME_AS_Q})}
_DEFAULTS = {"dtype_kv": SAME_AS_Q, "dtype_o": DEFAULT_OUTPUT, "head_dim_vo": SAME_AS_Q}
_REQUIRED = ("kind", "backend", "dtype_q", "head_dim_qk")
_META_KEYS = {"name", "on_invalid"}
_KEYS = sorted({*_PARSERS, *_META_KEYS, "head_dim"})
# Spec fields a manifest does not take, with the reason.
_NOT_TAKEN = {"fp16_qk_reduction": "no kernel accumulates q.k in fp16 (rule no-fp16-qk-reduction)"}
_TOP_LEVEL = {"defaults": "[defaults]", "group": "[[group]]"}


def _near(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _parse_table(table: dict, where: str) -> dict:
    """One [defaults] or [[group]] table, every value checked: {field: parsed list | follow sentinel | meta}."""
    out = {}
    for key, raw in table.items():
        path = f"{where}.{key}"
        if key in _NOT_TAKEN:
            raise ManifestError(f"{path}: not a manifest field: {_NOT_TAKEN[key]}")
        if key not in _KEYS:
            raise ManifestError(f"{path}: unknown field{_near(key, _KEYS)} (fields: {', '.join(_KEYS)})")
        if key == "name":
            if not isinstance(raw, str):
                raise ManifestError(f"{path}: expected a string, got {_show(raw)}")
            out[key] = raw
            continue
        if key == "on_invalid":
            if raw not in ("skip", "error"):
                raise ManifestError(f"{path}: expected \"skip\" or \"error\", got {_show(raw)}")
            out[key] = raw
            continue
        target = "head_dim_qk" if key == "head_dim" else key
        if key == "head_dim":
            if "head_dim_qk" in table or "head_dim_vo" in table:
                raise ManifestError(f"{where}: give either head_dim or head_dim_qk/head_dim_vo, not both")
            out["head_dim_vo"] = SAME_AS_Q
        if target in _FOLLOW and isinstance(raw, str) and raw in _FOLLOW[target][1]:
            out[target] = raw
            continue
        if isinstance(raw, list) and not raw:
            raise ManifestError(f"{path}: empty list (give at least one value)")
        items = raw if isinstance(raw, list) else [raw]
        parsed = []
        for index, item in enumerate(items):
            try:
                parsed.append(_PARSERS[target](item))
            except ValueError as exc:
                at = f"{path}[{index}]" if isinstance(raw, list) else path
                raise ManifestError(f"{at}: {exc}") from None
        out[target] = parsed
    return out


def _expand_group(fields: dict, where: str) -> Expansion:
    missing = [key for key in _REQUIRED if key not in fields]
    if missing:
        names = ", ".join("head_dim" if k == "head_dim_qk" else k for k in missing)
        raise ManifestError(f"{where}: missing {names} (give them in the group or in [defaults])")
    fields = {**_DEFAULTS, **fields}
    on_invalid = fields.get("on_invalid", "skip")
    free = sorted(key for key in _PARSERS if isinstance(fields.get(key), list))
    out = Expansion()
    for combo in itertools.product(*(fields[key] for key in free)):
        kwargs = dict(zip(free, combo))
        for key, (source, _) in _FOLLOW.items():
            if fields[key] == DEFAULT_OUTPUT:
                kwargs[key] = kwargs[source].default_output
            elif fields[key] == SAME_AS_Q:
                kwargs[key] = kwargs[source]
        spec = KernelSpec(**kwargs)
        violations = check(spec)
        if not violations:
            out.specs.append(spec)
        elif on_invalid == "error":
            lines = "; ".join(rule.render(spec) for rule in violations)
            raise ManifestError(f"{where}: {spec.name} is refused: {lines}")
        else:
            out.refused.append((spec, violations))
    return out


def _top_level(data: dict, source: str) -> tuple[dict, list[dict]]:
    for key, value in data.items():
        if key not in _TOP_LEVEL:
            shape = "[[{}]]" if isinstance(value, list) else "[{}]" if isinstance(value, dict) else "{} ="
            close = difflib.get_close_matches(key, list(_TOP_LEVEL), n=1)
            hint = f"; did you mean {_TOP_LEVEL[close[0]]}?" if close else ""
            raise ManifestError(f"{source}: unknown top-level {shape.format(key)}{hint} "
                                "(a manifest holds one [defaults] table and [[group]] tables)")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ManifestError(f"{source}: defaults: expected a table ([defaults]), got {_show(defaults)}")
    groups = data.get("group")
    if groups is None or groups == []:
        raise ManifestError(f"{source}: a manifest needs at least one [[group]] table")
    if not isinstance(groups, list):
        raise ManifestError(f"{source}: group: expected an array of tables ([[group]]), got {_show(groups)}")
    for index, group in enumerate(groups):
        if not isinstance(group, dict):
            raise ManifestError(f"{source}: group[{index}]: expected a table ([[group]]), got {_show(group)}")
    return defaults, groups


def expand(data: dict, source: str = "<manifest>") -> Expansion:
    defaults, groups = _top_level(data, source)
    base = _parse_table(defaults, f"{source}: defaults")
    if "name" in base:
        raise ManifestError(f"{source}: defaults.name: a name labels one group; give it in the [[group]]")
    total = Expansion()
    seen = set()
    for index, group in enumerate(groups):
        where = f"{source}: group[{index}]"
        part = _expand_group({**base, **_parse_table(group, where)}, where)
        for spec in part.specs:
            if spec not in seen:
                seen.add(spec)
                total.specs.append(spec)
        total.refused.extend(part.refused)
    if not total.specs:
        counts = {}
        for _, violations in total.refused:
            for rule in violations:
                counts[rule.id] = counts.get(rule.id, 0) + 1
        reasons = ", ".join(f"{rule_id} x{n}" for rule_id, n in counts.items())
        raise ManifestError(f"{source}: the manifest yields no module: rules refuse all {len(total.refused)} "
                            f"combination(s) ({reasons}); set on_invalid = \"error\" in a group to see why")
    total.specs.sort(key=lambda s: s.name)
    return total


def load(path: Path) -> Expansion:
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ManifestError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
                            "save the manifest as UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from None
    return expand(data, str(path))
