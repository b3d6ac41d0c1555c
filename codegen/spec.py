"""KernelSpec: the single typed description of one kernel module; everything else derives from it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from enum import Enum

from .dtypes import DType, IndexType
from .sources import source_hash


class Kind(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Backend(Enum):
    FA2 = "fa2"
    FA3 = "fa3"


class PosEncoding(Enum):
    """In-kernel positional encoding, FlashInfer's pos_encoding_mode."""

    NONE = "NONE"
    ROPE_LLAMA = "ROPE_LLAMA"
    ALIBI = "ALIBI"


class Arch(Enum):
    """A compile target. `a` targets carry the arch-specific Hopper instructions (wgmma, setmaxnreg)."""

    SM80 = "80"
    SM86 = "86"
    SM89 = "89"
    SM90 = "90"
    SM90A = "90a"

    @property
    def gencode(self) -> str:
        return f"-gencode=arch=compute_{self.value},code=sm_{self.value}"

    @property
    def major(self) -> int:
        return int(self.value.removesuffix("a")) // 10

    @classmethod
    def parse(cls, text: str) -> "Arch":
        """Accept "90a", "sm_90a", "9.0a", "8.0"."""
        norm = text.strip().lower().removeprefix("sm_").removeprefix("sm").replace(".", "")
        for member in cls:
            if member.value == norm:
                return member
        raise ValueError(f"unknown arch {text!r}; expected one of {', '.join(m.value for m in cls)}")


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """Every compile-time knob of one module. Run-time choices (causal, page size, kv layout,
    GQA group, split-KV) are not here: one module serves them all."""

    kind: Kind
    backend: Backend
    dtype_q: DType
    dtype_kv: DType
    dtype_o: DType
    idtype: IndexType = IndexType.I32
    head_dim_qk: int
    head_dim_vo: int
    pos_encoding: PosEncoding = PosEncoding.NONE
    use_sliding_window: bool = False
    use_logits_soft_cap: bool = False
    use_custom_mask: bool = False
    fp16_qk_reduction: bool = False
    archs: tuple[Arch, ...] = (Arch.SM80,)

    def __post_init__(self) -> None:
        # Canonical arch order so that equal target sets give equal specs and uris.
        ordered = tuple(sorted(set(self.archs), key=lambda a: list(Arch).index(a)))
        object.__setattr__(self, "archs", ordered)

    @property
    def arch_list(self) -> str:
        return ", ".join("sm_" + a.value for a in self.archs)

    @property
    def name(self) -> str:
        """Readable, injective name of the spec (no hash)."""
        hd = f"hd{self.head_dim_qk}" if self.head_dim_qk == self.head_dim_vo else f"hd{self.head_dim_qk}x{self.head_dim_vo}"
        flags = "".join(
            f"_{tag}{int(on)}"
            for tag, on in (
                ("swa", self.use_sliding_window),
                ("cap", self.use_logits_soft_cap),
                ("mask", self.use_custom_mask),
                ("f16qk", self.fp16_qk_reduction),
            )
        )
        archs = "_".join(a.value for a in self.archs)
        return (
            f"{self.kind.value}_{self.backend.value}_q{self.dtype_q.short}_kv{self.dtype_kv.short}"
            f"_o{self.dtype_o.short}_{self.idtype.short}_{hd}_pe{self.pos_encoding.value.lower()}{flags}_sm{archs}"
        )

    @property
    def uri(self) -> str:
        """Module name: the readable name plus a hash of the canonical spec and of every template
        and header source, so a changed template never loads a stale module."""
        digest = hashlib.sha256((json.dumps(self.to_dict(), sort_keys=True) + source_hash()).encode()).hexdigest()
        return f"{self.name}_{digest[:10]}"

    def to_dict(self) -> dict:
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Enum):
                value = value.name
            elif isinstance(value, tuple):
                value = [v.name for v in value]
            out[field.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "KernelSpec":
        enums = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in data.items():
            if key not in enums:
                raise ValueError(f"unknown KernelSpec field {key!r}")
            enum_type = _FIELD_ENUMS.get(key)
            if key == "archs":
                kwargs[key] = tuple(Arch[v] for v in value)
            elif enum_type is not None:
                kwargs[key] = enum_type[value]
            else:
                kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def parse_name(cls, name: str) -> "KernelSpec":
        """Inverse of `name` (a uri's hash suffix is ignored)."""
        match = _NAME_RE.fullmatch(name) or _NAME_RE.fullmatch(name.rsplit("_", 1)[0])
        if match is None:
            raise ValueError(f"{name!r} is not an attnforge module name")
        g = match.groupdict()
        qk = int(g["qk"])
        return cls(
            kind=Kind(g["kind"]),
            backend=Backend(g["backend"]),
            dtype_q=DType.parse(g["q"]),
            dtype_kv=DType.parse(g["kv"]),
            dtype_o=DType.parse(g["o"]),
            idtype=IndexType.parse(g["idx"]),
            head_dim_qk=qk,
            head_dim_vo=int(g["vo"]) if g["vo"] else qk,
            pos_encoding=PosEncoding(g["pe"].upper()),
            use_sliding_window=g["swa"] == "1",
            use_logits_soft_cap=g["cap"] == "1",
            use_custom_mask=g["mask"] == "1",
            fp16_qk_reduction=g["f16qk"] == "1",
            archs=tuple(Arch(a) for a in g["archs"].split("_")),
        )


_FIELD_ENUMS = {
    "kind": Kind,
    "backend": Backend,
    "dtype_q": DType,
    "dtype_kv": DType,
    "dtype_o": DType,
    "idtype": IndexType,
    "pos_encoding": PosEncoding,
}

_NAME_RE = re.compile(
    r"(?P<kind>prefill|decode)_(?P<backend>fa2|fa3)_q(?P<q>\w+?)_kv(?P<kv>\w+?)_o(?P<o>\w+?)_(?P<idx>i32)"
    r"_hd(?P<qk>\d+)(?:x(?P<vo>\d+))?_pe(?P<pe>none|rope_llama|alibi)_swa(?P<swa>[01])_cap(?P<cap>[01])"
    r"_mask(?P<mask>[01])_f16qk(?P<f16qk>[01])_sm(?P<archs>(?:80|86|89|90a|90)(?:_(?:80|86|89|90a|90))*)"
)
