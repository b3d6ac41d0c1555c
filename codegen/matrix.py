"""The support matrix: which (kind, backend, dtypes, head dims) combinations have a kernel.

Every cell is computed by `rules.check()`; there is no second table to keep in sync, so the README,
`attnforge matrix` and the runtime cannot disagree about what is supported.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .dtypes import DType
from . import rules
from .rules import check
from .spec import Arch, Backend, KernelSpec, Kind

# The head dims users ask for (every listed one, and qk > vo pairs: the MLA-like (192, 128) and two
# more of the 36 prefill takes), plus refused ones so the table shows which rule refuses them: 72
# (not a multiple of 16), 144 (on the grid but not instantiated), 384 (wider than a prefill row's
# accumulator), 512 (fa2 only: Gemma's), vo over qk.
HEAD_DIMS: tuple[tuple[int, int], ...] = tuple((d, d) for d in rules.HEAD_DIMS) + (
    (192, 128), (256, 128), (128, 64), (72, 72), (144, 144), (384, 384), (512, 512), (128, 192))

# Each backend is probed on an arch it can target, so the arch rules never hide the rule that matters.
PROBE_ARCHS = {Backend.FA2: (Arch.SM80,), Backend.FA3: (Arch.SM90A,)}


@dataclass(frozen=True)
class Row:
    spec: KernelSpec
    violations: tuple[str, ...]  # rule ids, in table order

    @property
    def supported(self) -> bool:
        return not self.violations


def rows(kinds=tuple(Kind), backends=tuple(Backend)) -> list[Row]:
    """One row per kind x backend x (q, kv) dtype pair x head-dim pair."""
    out = []
    for kind, backend, dtype_q, dtype_kv, (qk, vo) in itertools.product(kinds, backends, DType, DType, HEAD_DIMS):
        spec = KernelSpec(
            kind=kind,
            backend=backend,
            dtype_q=dtype_q,
            dtype_kv=dtype_kv,
            dtype_o=dtype_q.default_output,
            head_dim_qk=qk,
            head_dim_vo=vo,
            archs=PROBE_ARCHS[backend],
        )
        out.append(Row(spec, tuple(rule.id for rule in check(spec))))
    return out


def markdown(table: list[Row]) -> str:
    """The rows as a markdown table (one line per row, trailing newline)."""
    lines = [
        "| kind | backend | q | kv | o | head dims (qk, vo) | supported | refused by |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in table:
        s = row.spec
        lines.append(
            f"| {s.kind.value} | {s.backend.value} | {s.dtype_q.short} | {s.dtype_kv.short} | {s.dtype_o.short}"
            f" | {s.head_dim_qk}, {s.head_dim_vo} | {'yes' if row.supported else 'no'} | {', '.join(row.violations)} |"
        )
    return "\n".join(lines) + "\n"
