"""attnforge.cascade: FlashInfer's state-merging functions at FlashInfer's path.

merge_state and merge_states are attnforge.merge's (base-2 LSE, exact, sync-free);
merge_state_in_place merges a second state into the first's tensors, for rows a mask selects;
under torch.compile it is the custom op attnforge::merge_state_in_place (runtime/compile_ops.py).
"""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from .merge import _check_pair, merge_state, merge_states

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:
    """Merge the state (v_other, s_other) into (v, s), in place: v [seq, heads, D] keeps its dtype,
    s [seq, heads] must be float32 (it receives the merged base-2 LSE). mask: bool [seq] on v's
    device; rows where it is False keep their state. No host synchronisation."""
    if is_compiling():
        torch.ops.attnforge.merge_state_in_place(v, s, v_other, s_other, mask)
        return
    _check_pair("v", v, "s", s, v_dims=3)
    _check_pair("v_other", v_other, "s_other", s_other, v_dims=3)
    if v_other.shape != v.shape or v_other.device != v.device:
        raise ValueError(f"v_other: expected v's shape {tuple(v.shape)} on {v.device}, got "
                         f"{tuple(v_other.shape)} on {v_other.device}")
    if s.dtype != torch.float32:
        raise ValueError(f"s: expected dtype torch.float32 (it receives the merged LSE), got {s.dtype}")
    merged_v, merged_s = merge_state(v, s, v_other.to(v.dtype), s_other)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (v.shape[0],):
            raise ValueError(f"mask: expected a bool tensor of shape ({v.shape[0]},) (one flag per row), got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)} of shape "
                             f"{tuple(getattr(mask, 'shape', ()))}")
        if mask.device != v.device:
            raise ValueError(f"mask: expected a tensor on {v.device}, got one on {mask.device}")
        merged_v = torch.where(mask[:, None, None], merged_v, v)
        merged_s = torch.where(mask[:, None], merged_s, s)
    v.copy_(merged_v)
    s.copy_(merged_s)
