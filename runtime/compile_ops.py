"""torch.compile support: the public run()/merge/single_* entry points as torch.library custom ops.

Why this exists: Dynamo cannot trace into a ctypes call (a wrapper's run() patches a params struct
and calls into the module's C ABI), so without ops every attention call is a graph break and
`torch.compile(fullgraph=True)` fails. Each entry point therefore checks, first thing,
`torch.compiler.is_compiling()` (~0.1 µs; eager callers pay nothing else) and, only while Dynamo
traces, returns the custom op defined here instead. The op's real implementation calls the same
eager function, so a compiled graph launches exactly the kernels eager code launches (same
numbers, bit for bit); its fake implementation gives the outputs' shapes and dtypes from the op's
arguments alone, so tracing needs neither a plan nor a GPU.

Conventions of the ops (namespace `attnforge`):
- A wrapper is not an op argument: each wrapper registers itself in `_live` (weak references, so a
  compiled function never keeps one alive) and the op takes its int `handle`. plan() stays eager;
  the planned output dtype is read from the wrapper at trace time (plan() ran before the call
  that is traced) and passed explicitly as `o_dtype`, which Dynamo guards: a plan with another
  output dtype recompiles. A later plan() with the same dtypes reuses the compiled graph.
- A scale may be a float or a tensor: ops take `scale_tensors` ([q, k, v] tensor or None) beside
  `q_scale`/`k_scale`/`v_scale` floats; at most one of each pair is set.
- Outputs are fresh tensors (o, lse); lse is a 0-element tensor when return_lse is False. When
  the caller passes `out=` or `lse=`, the `*_out` op writes them in place (declared in
  mutates_args) and returns nothing: a custom op may not return an alias of its input.
- Shapes: o is q.shape[:-1] + (head_dim_vo,), head_dim_vo being V's last dim; lse is
  q.shape[:-1], float32. This holds for every entry point (decode q [batch, heads, dim], prefill
  q [tokens, heads, dim], single decode q [heads, dim]).

`batch_run`, `single_decode` and `single_prefill` are what the entry points call while Dynamo
traces: they only read metadata, pick the op and call it. The op definitions are private; use
them as `torch.ops.attnforge.<name>`.
"""

import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor

from attnforge.codegen.dtypes import DType

from . import dispatch

# ---------------------------------------------------------------------------------- wrapper handles
_live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def register(wrapper) -> int:
    """A new handle for `wrapper`, valid while the wrapper lives (called by every wrapper's __init__)."""
    handle = next(_handles)
    _live[handle] = wrapper
    return handle


def wrapper_of(handle: int):
    wrapper = _live.get(handle)
    if wrapper is None:
        raise RuntimeError(f"attnforge: wrapper handle {handle} is gone: the wrapper a compiled function was "
                           "traced with was garbage-collected; keep the wrapper alive while the function is used")
    return wrapper


# --------------------------------------------------------------------------------- shared helpers
_SCALE_NAMES = ("q_scale", "k_scale", "v_scale")
# The o dtype plan() picks when none is given: the query's own, bf16 for an fp8 query.
_DEFAULT_O = {dispatch.torch_dtype(member): dispatch.torch_dtype(member.default_output) for member in DType}


def _split_scales(*scales) -> tuple[list, list]:
    """(tensor or None per scale, float or None per scale): the op form of float-or-tensor scales."""
    tensors = [s if isinstance(s, Tensor) else None for s in scales]
    floats = [None if isinstance(s, Tensor) else s for s in scales]
    return tensors, floats


def _join_scales(tensors: list, floats: tuple) -> list:
    return [t if t is not None else f for t, f in zip(tensors, floats)]


def _new_outputs(q: Tensor, head_dim_vo: int, o_dtype: torch.dtype, return_lse: bool) -> tuple[Tensor, Tensor]:
    """Empty (o, lse) as the kernels write them; lse has 0 elements unless asked for."""
    o = q.new_empty((*q.shape[:-1], head_dim_vo), dtype=o_dtype)
    lse = q.new_empty(tuple(q.shape[:-1]) if return_lse else (0,), dtype=torch.float32)
    return o, lse


def _op_result(result, return_lse: bool, device) -> tuple[Tensor, Tensor]:
    """An eager entry point's o or (o, lse) as the ops' (o, lse) pair."""
    if return_lse:
        return result
    return result, torch.empty(0, dtype=torch.float32, device=device)


def _as_returned(o: Tensor, lse: Tensor, return_lse: bool):
    return (o, lse) if return_lse else o


def out_dtype(q_dtype: torch.dtype, o_dtype) -> torch.dtype:
    """The output dtype a single_* call gets: o_dtype (a dtype or its name), else plan()'s default."""
    if o_dtype is None:
        return _DEFAULT_O.get(q_dtype, q_dtype)
    if isinstance(o_dtype, torch.dtype):
        return o_dtype
    return dispatch.torch_dtype(dispatch.to_dtype(o_dtype, "o_dtype"))


# ------------------------------------------------------------------------- batch wrappers' run()
# Per op family: how the eager run() takes the KV tensors (a paged cache as one argument, a
# (k, v) pair or a single tensor; ragged k and v as two arguments).
def _paged_kv(k: Tensor, v: Optional[Tensor]) -> tuple:
    return ((k, v),) if v is not None else (k,)


def _ragged_kv(k: Tensor, v: Optional[Tensor]) -> tuple:
    return (k, v)


_FAMILIES = {"batch_decode": _paged_kv, "batch_prefill_paged": _paged_kv, "batch_prefill_ragged": _ragged_kv}


def _run_eager(kv_args, handle, q, k, v, positional, scale_tensors, scale_floats, enable_pdl, window_left, sinks,
               out, lse, return_lse):
    scales = dict(zip(_SCALE_NAMES, _join_scales(scale_tensors, scale_floats)))
    return wrapper_of(handle).run(q, *kv_args(k, v), *positional, out=out, lse=lse, return_lse=return_lse,
                                  enable_pdl=enable_pdl, window_left=window_left, sinks=sinks, **scales)


def _define_batch_ops(family: str, kv_args) -> tuple:
    """attnforge::<family>_run (fresh o, lse) and attnforge::<family>_run_out (writes out, lse)."""

    @torch.library.custom_op(f"attnforge::{family}_run", mutates_args=())
    def run(handle: int, q: Tensor, k: Tensor, v: Optional[Tensor], positional: list[Tensor],
            scale_tensors: list[Optional[Tensor]], q_scale: Optional[float], k_scale: Optional[float],
            v_scale: Optional[float], enable_pdl: Optional[bool], window_left: Optional[int], sinks: Optional[Tensor],
            return_lse: bool, o_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        result = _run_eager(kv_args, handle, q, k, v, positional, scale_tensors, (q_scale, k_scale, v_scale),
                            enable_pdl, window_left, sinks, None, None, return_lse)
        return _op_result(result, return_lse, q.device)

    @run.register_fake
    def _(handle, q, k, v, positional, scale_tensors, q_scale, k_scale, v_scale, enable_pdl, window_left, sinks,
          return_lse, o_dtype):
        return _new_outputs(q, (k if v is None else v).shape[-1], o_dtype, return_lse)

    @torch.library.custom_op(f"attnforge::{family}_run_out", mutates_args=("out", "lse"))
    def run_out(handle: int, q: Tensor, k: Tensor, v: Optional[Tensor], positional: list[Tensor],
                scale_tensors: list[Optional[Tensor]], q_scale: Optional[float], k_scale: Optional[float],
                v_scale: Optional[float], enable_pdl: Optional[bool], window_left: Optional[int],
                sinks: Optional[Tensor], out: Tensor, lse: Optional[Tensor]) -> None:
        _run_eager(kv_args, handle, q, k, v, positional, scale_tensors, (q_scale, k_scale, v_scale), enable_pdl,
                   window_left, sinks, out, lse, lse is not None)

    @run_out.register_fake
    def _(handle, q, k, v, positional, scale_tensors, q_scale, k_scale, v_scale, enable_pdl, window_left, sinks, out,
          lse):
        return None

    return run, run_out


_BATCH_OPS = {family: _define_batch_ops(family, kv_args) for family, kv_args in _FAMILIES.items()}


def batch_run(family: str, wrapper, o_dtype: torch.dtype, q: Tensor, kv, args: tuple, q_scale, k_scale, v_scale,
              out, lse, return_lse: bool, enable_pdl, window_left, sinks):
    """A wrapper's run() while Dynamo traces: the family's op with the wrapper's handle. kv is the
    paged cache (a (k, v) pair or one tensor) or the ragged (k, v)."""
    if isinstance(kv, (tuple, list)) and len(kv) == 2:
        k, v = kv
    elif isinstance(kv, Tensor):
        k, v = kv, None
    else:
        raise ValueError("paged_kv_cache: expected a (k_cache, v_cache) pair or one [num_pages, 2, ...] tensor")
    positional = list(args)
    if not all(isinstance(x, Tensor) for x in positional):
        raise TypeError("run(): under torch.compile extra positional arguments must be tensors (FlashInfer's fp8 "
                        "q/k/v scales); pass float scales as q_scale=/k_scale=/v_scale=")
    tensors, floats = _split_scales(q_scale, k_scale, v_scale)
    common = (wrapper._handle, q, k, v, positional, tensors, *floats, enable_pdl, window_left, sinks)
    run, run_out = _BATCH_OPS[family]
    if out is None and (lse is None or not return_lse):
        o, s = run(*common, return_lse, o_dtype)
        return _as_returned(o, s, return_lse)
    new_o, new_lse = _new_outputs(q, (k if v is None else v).shape[-1], o_dtype, return_lse)
    out = new_o if out is None else out
    lse = (new_lse if lse is None else lse) if return_lse else None
    run_out(*common, out, lse)
    return _as_returned(out, lse, return_lse)


# ------------------------------------------------------------------------------------- single_*
@torch.library.custom_op("attnforge::single_decode", mutates_args=())
def _single_decode(q: Tensor, k: Tensor, v: Tensor, kv_layout: str, pos_encoding_mode: str, use_tensor_cores: bool,
                   scale_tensors: list[Optional[Tensor]], q_scale: Optional[float], k_scale: Optional[float],
                   v_scale: Optional[float], window_left: int, logits_soft_cap: Optional[float],
                   sm_scale: Optional[float], rope_scale: Optional[float], rope_theta: Optional[float],
                   return_lse: bool, o_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from .decode import single_decode_with_kv_cache

    scales = dict(zip(_SCALE_NAMES, _join_scales(scale_tensors, (q_scale, k_scale, v_scale))))
    result = single_decode_with_kv_cache(
        q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, window_left=window_left,
        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        return_lse=return_lse, **scales)
    return _op_result(result, return_lse, q.device)


@_single_decode.register_fake
def _(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, scale_tensors, q_scale, k_scale, v_scale, window_left,
      logits_soft_cap, sm_scale, rope_scale, rope_theta, return_lse, o_dtype):
    return _new_outputs(q, v.shape[-1], o_dtype, return_lse)


def single_decode(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
                  logits_soft_cap, sm_scale, rope_scale, rope_theta, return_lse):
    """single_decode_with_kv_cache while Dynamo traces (same arguments)."""
    tensors, floats = _split_scales(q_scale, k_scale, v_scale)
    o, lse = _single_decode(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, tensors, *floats, window_left,
                            logits_soft_cap, sm_scale, rope_scale, rope_theta, return_lse, out_dtype(q.dtype, None))
    return _as_returned(o, lse, return_lse)


@torch.library.custom_op("attnforge::single_prefill", mutates_args=())
def _single_prefill(q: Tensor, k: Tensor, v: Tensor, scale_tensors: list[Optional[Tensor]], scale_q: Optional[float],
                    scale_k: Optional[float], scale_v: Optional[float], o_dtype: torch.dtype,
                    custom_mask: Optional[Tensor], packed_custom_mask: Optional[Tensor], causal: bool, kv_layout: str,
                    pos_encoding_mode: str, use_fp16_qk_reduction: bool, sm_scale: Optional[float], window_left: int,
                    logits_soft_cap: Optional[float], rope_scale: Optional[float], rope_theta: Optional[float],
                    backend: str, return_lse: bool, kv_cache_sf: Optional[Tensor], k_scale: Optional[float],
                    v_scale: Optional[float]) -> tuple[Tensor, Tensor]:
    from .prefill import single_prefill_with_kv_cache

    scale_q, scale_k, scale_v = _join_scales(scale_tensors, (scale_q, scale_k, scale_v))
    result = single_prefill_with_kv_cache(
        q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
        pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
        backend, return_lse, kv_cache_sf, k_scale, v_scale)
    return _op_result(result, return_lse, q.device)


@_single_prefill.register_fake
def _(q, k, v, scale_tensors, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
      pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
      backend, return_lse, kv_cache_sf, k_scale, v_scale):
    return _new_outputs(q, v.shape[-1], o_dtype, return_lse)


def single_prefill(q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
                   pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
                   rope_theta, backend, return_lse, kv_cache_sf, k_scale, v_scale):
    """single_prefill_with_kv_cache while Dynamo traces (same arguments, in FlashInfer's order)."""
    tensors, floats = _split_scales(scale_q, scale_k, scale_v)
    o, lse = _single_prefill(q, k, v, tensors, *floats, out_dtype(q.dtype, o_dtype), custom_mask, packed_custom_mask,
                             causal, kv_layout, pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left,
                             logits_soft_cap, rope_scale, rope_theta, backend, return_lse, kv_cache_sf, k_scale,
                             v_scale)
    return _as_returned(o, lse, return_lse)


# --------------------------------------------------------------------------------------- merges
# The merges are plain torch code that Dynamo could trace; they are ops all the same so a compiled
# graph computes exactly eager's numbers (Inductor would fuse and reorder the fp32 math) and so a
# CUDA merge kernel can replace them without touching any caller.
@torch.library.custom_op("attnforge::merge_state", mutates_args=())
def _merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> tuple[Tensor, Tensor]:
    from . import merge

    return merge.merge_state(v_a, s_a, v_b, s_b)


@_merge_state.register_fake
def _(v_a, s_a, v_b, s_b):
    from . import merge

    merge.check_merge_state(v_a, s_a, v_b, s_b)
    return v_a.new_empty(v_a.shape), s_a.new_empty(s_a.shape, dtype=torch.float32)


@torch.library.custom_op("attnforge::merge_states", mutates_args=())
def _merge_states(v: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    from . import merge

    return merge.merge_states(v, s)


@_merge_states.register_fake
def _(v, s):
    from . import merge

    merge.check_states(v, s)
    seq, _, heads, head_dim = v.shape
    return v.new_empty((seq, heads, head_dim)), s.new_empty((seq, heads), dtype=torch.float32)


@torch.library.custom_op("attnforge::merge_state_in_place", mutates_args=("v", "s"))
def _merge_state_in_place(v: Tensor, s: Tensor, v_other: Tensor, s_other: Tensor, mask: Optional[Tensor]) -> None:
    from . import cascade

    cascade.merge_state_in_place(v, s, v_other, s_other, mask)


@_merge_state_in_place.register_fake
def _(v, s, v_other, s_other, mask):
    return None
