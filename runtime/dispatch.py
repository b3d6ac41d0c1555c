"""From run-time arguments to a KernelSpec: dtype and arch mapping, backend resolution."""

from __future__ import annotations

import dataclasses
import functools

import torch

from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import check, ensure_valid
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding

from .settings import settings

BACKENDS = ("auto", "fa2", "fa3")
_CAPABILITY_ARCH = {(8, 0): Arch.SM80, (8, 6): Arch.SM86, (8, 7): Arch.SM86, (8, 9): Arch.SM89, (9, 0): Arch.SM90A}


def to_dtype(value, argument: str, *, allow_none: bool = False) -> DType | None:
    """A torch dtype or its name ("bfloat16", "bf16") as a DType; errors name the argument."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.dtype):
        member = _BY_TORCH_DTYPE.get(value)
        if member is not None:
            return member
        raise ValueError(f"{argument}: {value} is not an attention dtype; expected one of "
                         f"{', '.join('torch.' + m.torch_name for m in DType)}")
    if isinstance(value, str):
        try:
            return DType.parse(value)
        except ValueError as exc:
            raise ValueError(f"{argument}: {exc}") from None
    raise TypeError(f"{argument}: expected a torch.dtype or a dtype name, got {type(value).__name__} {value!r}")


def planned_dtypes(q_data_type, kv_data_type, o_data_type) -> tuple[DType, DType, DType]:
    """(q, kv, o) dtypes of a plan: kv defaults to q's, o to q's default output (bf16 for fp8 q)."""
    dtype_q = to_dtype(q_data_type, "q_data_type")
    dtype_kv = to_dtype(kv_data_type, "kv_data_type", allow_none=True) or dtype_q
    dtype_o = to_dtype(o_data_type, "o_data_type", allow_none=True) or dtype_q.default_output
    return dtype_q, dtype_kv, dtype_o


def torch_dtype(dtype: DType) -> torch.dtype:
    return getattr(torch, dtype.torch_name)


# plan() resolves its dtype arguments every serving step: a dict lookup, not a scan of DType.
_BY_TORCH_DTYPE = {torch_dtype(member): member for member in DType}


@functools.cache
def device_archs(device_index: int) -> tuple[Arch, ...]:
    """Compile targets for a device: ATTNFORGE_CUDA_ARCH_LIST if set, else the device's own arch."""
    override = settings().cuda_arch_list
    if override:
        return override
    capability = torch.cuda.get_device_capability(device_index)
    arch = _CAPABILITY_ARCH.get(capability)
    if arch is None:
        raise RuntimeError(f"cuda:{device_index} is sm_{capability[0]}{capability[1]}; attnforge builds for "
                           f"{', '.join('sm_' + a.value for a in Arch)}")
    return (arch,)


@functools.cache
def device_has_pdl(device_index: int) -> bool:
    """Programmatic dependent launch needs sm90 or newer (FlashInfer's device_support_pdl)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_flag(enable_pdl: bool | None, device_index: int) -> int:
    """run()'s enable_pdl as the params' flag. FlashInfer's meaning: None is on where the device
    has PDL; True is a request, honoured only there ("only effective on devices that support PDL"),
    so on an older device it is off without an error. The kernels wait for their predecessor before
    touching memory either way, so the flag never changes a result."""
    return int((enable_pdl is None or bool(enable_pdl)) and device_has_pdl(device_index))


def parse_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    return backend


def parse_pos_encoding(mode) -> PosEncoding:
    if isinstance(mode, PosEncoding):
        return mode
    try:
        return PosEncoding(str(mode).upper())
    except ValueError:
        raise ValueError(f"pos_encoding_mode: expected one of {', '.join(m.value for m in PosEncoding)}, "
                         f"got {mode!r}") from None


def decode_spec(*, backend: str, dtype_q: DType, dtype_kv: DType, dtype_o: DType, head_dim: int,
                pos_encoding: PosEncoding, use_sliding_window: bool, use_logits_soft_cap: bool,
                archs: tuple[Arch, ...]) -> KernelSpec:
    """The CUDA-core decode spec for the planned arguments. "auto" resolves to fa2 (the only
    CUDA-core decode family); an explicit fa3 is refused by the rules with their suggestion."""
    spec = KernelSpec(
        kind=Kind.DECODE,
        backend=Backend.FA3 if backend == "fa3" else Backend.FA2,
        dtype_q=dtype_q,
        dtype_kv=dtype_kv,
        dtype_o=dtype_o,
        head_dim_qk=head_dim,
        head_dim_vo=head_dim,
        pos_encoding=pos_encoding,
        use_sliding_window=use_sliding_window,
        use_logits_soft_cap=use_logits_soft_cap,
        archs=archs,
    )
    return ensure_valid(spec)


def resolve_backend(backend: str, spec: KernelSpec) -> KernelSpec:
    """The spec with its backend decided. "auto" picks fa3 exactly when the targets include sm90a and
    every rule passes for the fa3 version of the spec (head dims, dtypes, mask, encoding included);
    otherwise fa2. An explicit backend is taken as asked, and a rule that refuses it raises with its
    message and suggestion."""
    if backend == "auto":
        fa3 = dataclasses.replace(spec, backend=Backend.FA3, archs=(Arch.SM90A,))
        if Arch.SM90A in spec.archs and not check(fa3):
            return fa3
        return ensure_valid(dataclasses.replace(spec, backend=Backend.FA2))
    chosen = Backend(backend)
    archs = (Arch.SM90A,) if chosen is Backend.FA3 and Arch.SM90A in spec.archs else spec.archs
    return ensure_valid(dataclasses.replace(spec, backend=chosen, archs=archs))


def prefill_spec(*, backend: str, dtype_q: DType, dtype_kv: DType, dtype_o: DType, head_dim_qk: int,
                 head_dim_vo: int, pos_encoding: PosEncoding, use_sliding_window: bool, use_logits_soft_cap: bool,
                 use_custom_mask: bool, archs: tuple[Arch, ...]) -> KernelSpec:
    """The prefill spec for the planned arguments, backend resolved by `resolve_backend`."""
    spec = KernelSpec(
        kind=Kind.PREFILL,
        backend=Backend.FA2,
        dtype_q=dtype_q,
        dtype_kv=dtype_kv,
        dtype_o=dtype_o,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        pos_encoding=pos_encoding,
        use_sliding_window=use_sliding_window,
        use_logits_soft_cap=use_logits_soft_cap,
        use_custom_mask=use_custom_mask,
        archs=archs,
    )
    return resolve_backend(backend, spec)
