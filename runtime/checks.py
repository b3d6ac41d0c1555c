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


def planned_tensor(x, name: str, expected_shape: tuple, layout: str, *, planned_dtype: torch.dtype, dtype_arg: str,
                   on: torch.device) -> torch.Tensor:
    """A tensor that run() hands a kernel as plan() described it: of `planned_dtype` (plan()'s
    `dtype_arg`), on the plan's device `on`, of `expected_shape` (`layout` naming its dims), with
    rows the kernel can move as 16-byte vectors."""
    tensor(x, name)
    dtype(x, name, planned_dtype, f"{dtype_arg} given to plan()")
    device(x, name, on)
    shape(x, name, expected_shape, layout)
    vector_aligned(x, name)
    return x


def cuda_tensor(x, name: str) -> torch.Tensor:
    """A tensor on a CUDA device (where the kernels read it)."""
    tensor(x, name)
    if not x.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor (the kernels read it on the GPU), got one on {x.device}")
    return x


def cuda_device(value, name: str = "device") -> torch.device:
    """A CUDA device with its index, from a torch.device, a string or an index; None is the current
    CUDA device."""
    if value is None:
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: None means the current CUDA device, but CUDA is not available here")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name}: expected a CUDA device (torch.device, 'cuda:N' or an index), got {value!r}") from None
    if device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA device (the kernels run there), got {device}")
    if device.index is None:
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {device} means the current CUDA device, but CUDA is not available here")
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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
    int_in(x.numel(), f"{name} entries", 0, INT32_MAX, "the planner indexes it with int32")
    return x.to("cpu").contiguous() if x.is_cuda else x.contiguous()


# The kernels' parameter and plan-argument structs hold sizes, counts and token positions in int32
# fields (codegen/abi.py): a larger Python int would wrap there, silently (2**32 + 16 becomes 16).
INT32_MAX = 2**31 - 1
INT32 = "int32 field of the kernel"
MAX_GRID_Y = 65535
GRID_Y = "CUDA grid y dimension"


def int_in(value, name: str, lo: int, hi: int, why: str = INT32) -> int:
    """An int (not a bool) in [lo, hi]; `why` says where the bound comes from."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}] ({why}), got {value!r}")
    return value


def positive_int(value, name: str, hi: int = INT32_MAX, why: str = INT32) -> int:
    return int_in(value, name, 1, hi, why)


def heads(num_qo_heads, num_kv_heads) -> tuple[int, int]:
    """Query and kv head counts; the query heads must split evenly into GQA groups."""
    # Kernels launch a grid row per kv head (and the merge one per few query heads): CUDA's grid y
    # holds at most 65535, below the heads' int32 fields.
    num_qo_heads = positive_int(num_qo_heads, "num_qo_heads", MAX_GRID_Y, GRID_Y)
    num_kv_heads = positive_int(num_kv_heads, "num_kv_heads", MAX_GRID_Y, GRID_Y)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    return num_qo_heads, num_kv_heads


def window_left(value) -> int:
    return int_in(value, "window_left", -1, INT32_MAX, f"-1: no window; {INT32}")


def int32_times(value, name: str, factor: int, why: str, lo: int = 1) -> int:
    """An int whose product with `factor` the kernel addresses in int32 (a derived count: tokens
    of pages, packed query rows): bounded by INT32_MAX // factor, `why` saying what the product is."""
    return int_in(value, name, lo, INT32_MAX // max(factor, 1), f"{why}: int32 in the kernel")


def times_longest(value: int, name: str, indptr: torch.Tensor, unit: str, product: str) -> None:
    """`value` times each request's span of a host int32 indptr (its pages, its query tokens) is a
    per-request count the kernel holds in int32. O(1) when the whole batch's span fits; else one
    pass over the requests finds the longest."""
    total = int(indptr[-1]) - int(indptr[0])
    if total * value <= INT32_MAX:
        return
    longest = int(indptr.diff().max())
    int32_times(value, name, longest, f"times the longest request's {longest} {unit}, its {product}")


def plan_image_size(size: int, capacity: int) -> int:
    """The plan image's int32 entries: the planner's offsets and image_size are int32 fields (only a
    tiny fixed_split_size over a huge batch reaches this)."""
    if size > INT32_MAX:
        raise ValueError(f"plan(): the plan image needs {size} int32 entries ({capacity} work items), expected at most "
                         f"{INT32_MAX} (its offsets are int32 fields of the kernel); use a larger fixed_split_size or "
                         "split the batch")
    return size


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


def split_size(value, page_size: int = 1) -> None:
    """fixed_split_size: None or -1 (automatic), else a positive number of pages whose tokens
    (times page_size) fit the planner's int32 fixed_split_tokens."""
    if value is not None and value != -1:
        int32_times(value, "fixed_split_size", page_size, f"times page_size={page_size}, the kv tokens of a chunk")


def run_extras(planned_window_left: int, enable_pdl, window_left) -> None:
    """run() arguments FlashInfer has that need a check here: enable_pdl is True, False or None
    (dispatch.pdl_flag reads it), and a window may only repeat the planned one (the plan cut the kv
    ranges to it). sinks are checked by checks.sinks."""
    if enable_pdl is not None and enable_pdl not in (True, False):
        raise ValueError(f"enable_pdl: expected True, False or None (on where the device supports PDL), got "
                         f"{enable_pdl!r}")
    if window_left is not None and window_left != planned_window_left:
        raise ValueError(f"window_left: plan() was called with {planned_window_left}, run() got {window_left}; "
                         "plan again to change the window")


def sinks(x, num_qo_heads: int, expected_device: torch.device) -> torch.Tensor:
    """run()'s attention sinks: a contiguous float32 tensor [num_qo_heads] on the plan's device, one
    logit per query head (natural log, in the units of the scaled scores), that the kernels read."""
    tensor(x, "sinks")
    dtype(x, "sinks", torch.float32, "one fp32 logit per query head")
    device(x, "sinks", expected_device)
    shape(x, "sinks", (num_qo_heads,), "[num_qo_heads]")
    if not x.is_contiguous():
        raise ValueError(f"sinks: expected a contiguous tensor, got strides {tuple(x.stride())}")
    return x


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
