"""Argument checks for the public API. Each failure names the argument, what was expected and
what was given. Checks read tensor metadata only: none of them synchronizes with the GPU."""

from __future__ import annotations

import math
import warnings

import torch


def tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def dtype(x: torch.Tensor, name: str, expected: torch.dtype, why: str = "") -> None:
    if x.dtype != expected:
        because = f" ({why})" if why else ""
        raise ValueError(f"{name}: expected dtype {expected}{because}, got {x.dtype}")


def device(x: torch.Tensor, name: str, expected: torch.device) -> None:
    if x.device != expected:
        raise ValueError(f"{name}: expected a tensor on {expected} (where plan() ran), got one on {x.device}")


def shape(x: torch.Tensor, name: str, expected: tuple, layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({layout}), got {tuple(x.shape)}")


def vector_aligned(x: torch.Tensor, name: str) -> None:
    """Kernels move 16-byte vectors along the last dim: it must be contiguous and 16-byte aligned,
    and every other stride a whole number of vectors."""
    per_vector = 16 // x.element_size()
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(x.stride())}")
    if x.data_ptr() % 16 or any(s % per_vector for s in x.stride()[:-1]):
        raise ValueError(f"{name}: expected 16-byte aligned rows (strides multiple of {per_vector} elements, "
                         f"aligned storage), got strides {tuple(x.stride())} at address {x.data_ptr():#x}")


def host_int32(x, name: str, length: int | None = None) -> torch.Tensor:
    """A 1-D int32 tensor on the host. A CUDA tensor is copied over (which waits for the GPU:
    pass host tensors, as FlashInfer users do, to keep plan() asynchronous)."""
    tensor(x, name)
    if x.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if length is not None and x.numel() != length:
        raise ValueError(f"{name}: expected {length} entries, got {x.numel()}")
    return x.to("cpu").contiguous() if x.is_cuda else x.contiguous()


def positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def heads(num_qo_heads, num_kv_heads) -> tuple[int, int]:
    """Query and kv head counts; the query heads must split evenly into GQA groups."""
    num_qo_heads = positive_int(num_qo_heads, "num_qo_heads")
    num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    return num_qo_heads, num_kv_heads


def window_left(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"window_left: expected -1 (no window) or a non-negative int, got {value!r}")
    return value


def soft_cap(value) -> float:
    """logits_soft_cap as a float, 0.0 meaning none."""
    cap = float(value or 0.0)
    if cap < 0 or not math.isfinite(cap):
        raise ValueError(f"logits_soft_cap: expected None, 0 or a positive float, got {value!r}")
    return cap


def positive_float(value, name: str, default: float) -> float:
    """A positive finite float, or `default` for None (sm_scale, rope_scale, rope_theta)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name}: expected a positive float or None, got {value!r}")
    return float(value)


def split_size(value) -> None:
    """fixed_split_size: None or -1 (automatic), else a positive number of pages."""
    if value is not None and value != -1:
        positive_int(value, "fixed_split_size")


def run_extras(planned_window_left: int, enable_pdl, window_left, sinks, kernel: str) -> None:
    """run() arguments FlashInfer has that need a check here: enable_pdl is True, False or None
    (dispatch.pdl_flag reads it), sinks are refused, and a window may only repeat the planned one
    (the plan cut the kv ranges to it)."""
    if enable_pdl is not None and enable_pdl not in (True, False):
        raise ValueError(f"enable_pdl: expected True, False or None (on where the device supports PDL), got "
                         f"{enable_pdl!r}")
    if sinks is not None:
        raise ValueError(f"run(): attention sinks are not supported by {kernel}")
    if window_left is not None and window_left != planned_window_left:
        raise ValueError(f"window_left: plan() was called with {planned_window_left}, run() got {window_left}; "
                         "plan again to change the window")


def scale(value, name: str) -> float | None:
    """A per-tensor scale given as a Python number: the fa2 kernels (fp8 KV cache included) take
    float calibration scales; tensor (per-head) scales belong to the fa3 fp8 path."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: tensor scales are for the fa3 fp8 path (fp8 query and KV cache); "
                         f"this kernel takes a float, got a tensor of shape {tuple(value.shape)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a positive float or None, got {value!r}")
    return float(value)


_warned_extra_args = False


def positional_scales(args: tuple, fp8_query: bool, q_scale, k_scale, v_scale) -> tuple:
    """FlashInfer's fa3 fp8 form run(q, kv..., q_scale, k_scale, v_scale): with an fp8 query the
    three extra positional arguments are the scales (then not also given as keywords). With a
    16-bit query FlashInfer ignores extra positional arguments: so do we, warning once."""
    global _warned_extra_args
    if not args:
        return q_scale, k_scale, v_scale
    if not fp8_query:
        if not _warned_extra_args:
            _warned_extra_args = True
            warnings.warn(f"run(): {len(args)} extra positional argument(s) ignored, as FlashInfer ignores them with a "
                          "16-bit query; pass q_scale/k_scale/v_scale as keywords", stacklevel=3)
        return q_scale, k_scale, v_scale
    if len(args) != 3:
        raise TypeError(f"run(): with an fp8 query the extra positional arguments are (q_scale, k_scale, v_scale), "
                        f"got {len(args)}")
    if any(x is not None for x in (q_scale, k_scale, v_scale)):
        raise TypeError("run(): scales given both positionally and as keywords")
    return args


def head_scale(value, name: str, heads: int, device: torch.device) -> tuple[torch.Tensor | None, float | None]:
    """An fa3 fp8 scale: a float (per tensor), or a float32 tensor of one value per head ([heads])
    or one for all ([1]) on the tensors' device. Returns (tensor, None) or (None, float)."""
    if not isinstance(value, torch.Tensor):
        return None, scale(value, name)
    if value.dtype != torch.float32 or value.dim() != 1 or value.numel() not in (1, heads):
        raise ValueError(f"{name}: expected a float32 tensor of shape [{heads}] (per head) or [1], got "
                         f"{value.dtype} of shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {value.device}")
    if value.stride(0) != 1 and value.numel() > 1:
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {value.stride(0)}")
    return value, None


def indptr(x, name: str, *, entries: int | None = None, end: int | None = None) -> list[int]:
    """A 1-D integer index pointer as a host list: starts at 0, never decreases, has `entries`
    entries and ends at `end` when those are given. Reading it waits for the GPU if x is there."""
    tensor(x, name)
    if x.dim() != 1 or x.numel() == 0 or x.is_floating_point() or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected a non-empty 1-D integer tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if entries is not None and x.numel() != entries:
        raise ValueError(f"{name}: expected {entries} entries (batch_size + 1), got {x.numel()}")
    bounds = x.tolist()
    if bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name}: expected a non-decreasing index pointer starting at 0, got {bounds}")
    if end is not None and bounds[-1] != end:
        raise ValueError(f"{name}: expected the last entry to be {end}, got {bounds[-1]}")
    return bounds
