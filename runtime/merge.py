"""attnforge.merge: combine attention states computed over disjoint sets of keys.

A state is (v, s): v the softmax-normalised output over its keys and s its BASE-2 LSE,
s = log2(sum_j exp(score_j)), the form FlashInfer's kernels and merge_state use. Merging
is exact: the merge of the states of two halves of a key set is the state of the whole.

Math (fp32): M = max_i s_i, w_i = 2^(s_i - M), v = sum_i w_i v_i / sum_i w_i,
s = M + log2(sum_i w_i). A state with s = -inf is empty and has weight 0 (its v is
ignored, even if it is NaN); merging only empty states gives v = 0 and s = -inf.

Pure tensor ops with no host synchronisation, so both functions run inside CUDA graphs. Under
torch.compile both are the custom ops attnforge::merge_state(s) (runtime/compile_ops.py).
"""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from . import compile_ops  # noqa: F401  (registers the torch.ops.attnforge ops used below)

__all__ = ["merge_state", "merge_states"]


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def _check_pair(v_name: str, v: torch.Tensor, s_name: str, s: torch.Tensor, v_dims: int) -> None:
    """v has v_dims dims and s is v without its last (head_dim) axis, on the same device."""
    _check_float(v_name, v)
    _check_float(s_name, s)
    if v.dim() != v_dims:
        raise ValueError(f"{v_name} must have {v_dims} dims, got shape {_shape(v)}")
    if _shape(s) != _shape(v)[:-1]:
        raise ValueError(
            f"{s_name} must have shape {_shape(v)[:-1]} (the shape of {v_name} without head_dim), got {_shape(s)}"
        )
    if s.device != v.device:
        raise ValueError(f"{s_name} is on {s.device} but {v_name} is on {v.device}")


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge num_states states per (row, head).

    v [seq, num_states, heads, D] (any float dtype), s [seq, num_states, heads] (base-2 LSE).
    Returns (v [seq, heads, D] in v's dtype, s [seq, heads] fp32).
    """
    if is_compiling():
        return torch.ops.attnforge.merge_states(v, s)
    check_states(v, s)
    seq, num_states, heads, head_dim = v.shape
    if num_states == 0:  # the merge of nothing is the empty state
        return v.new_zeros(seq, heads, head_dim), torch.full(
            (seq, heads), float("-inf"), dtype=torch.float32, device=v.device
        )
    sf = s.float()
    m = sf.amax(dim=1, keepdim=True)  # [seq, 1, heads]
    # all-empty rows have m = -inf; shift by 0 there so w = 2^-inf = 0 instead of NaN
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp2(sf - m).unsqueeze(-1)  # [seq, states, heads, 1]; the largest state has w = 1
    # where() rather than w * v so an empty state's v (often garbage) cannot leak NaN in
    weighted = torch.where(w > 0, w * v.float(), torch.zeros((), dtype=torch.float32, device=v.device))
    denom = w.sum(dim=1)  # [seq, heads, 1]; >= 1 unless every state is empty, then 0
    v_out = weighted.sum(dim=1) / denom.clamp_min(1.0)
    s_out = m.squeeze(1) + torch.log2(denom.squeeze(-1))  # log2(0) = -inf for all-empty rows
    return v_out.to(v.dtype), s_out


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states: v_* [seq, heads, D], s_* [seq, heads] base-2 LSE.

    Returns (v [seq, heads, D] in v_a's dtype, s [seq, heads] fp32).
    """
    if is_compiling():
        return torch.ops.attnforge.merge_state(v_a, s_a, v_b, s_b)
    check_merge_state(v_a, s_a, v_b, s_b)
    v = torch.stack([v_a, v_b], dim=1)
    s = torch.stack([s_a.float(), s_b.float()], dim=1)
    return merge_states(v, s)


def check_states(v: torch.Tensor, s: torch.Tensor) -> None:
    """merge_states' argument checks (metadata only, so the fake op runs them too)."""
    _check_pair("v", v, "s", s, v_dims=4)


def check_merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> None:
    """merge_state's argument checks (metadata only, so the fake op runs them too)."""
    _check_pair("v_a", v_a, "s_a", s_a, v_dims=3)
    _check_pair("v_b", v_b, "s_b", s_b, v_dims=3)
    if _shape(v_b) != _shape(v_a):
        raise ValueError(f"v_b must have the shape of v_a {_shape(v_a)}, got {_shape(v_b)}")
    if v_b.device != v_a.device:
        raise ValueError(f"v_b is on {v_b.device} but v_a is on {v_a.device}")
    if v_b.dtype != v_a.dtype:
        raise ValueError(f"v_b must have v_a's dtype {v_a.dtype}, got {v_b.dtype}")
