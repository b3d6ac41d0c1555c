"""single_decode_with_kv_cache: FlashInfer's one-request decode over a contiguous KV, run on the batch
decode wrapper (reached as attnforge.decode.single_decode_with_kv_cache, as in FlashInfer)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from . import compile_ops, decode, kv_cache

_single_workspaces: dict[torch.device, torch.Tensor] = {}


def single_decode_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", use_tensor_cores: bool = False, q_scale=None,
                                k_scale=None, v_scale=None, window_left: int = -1, logits_soft_cap: float | None = None,
                                sm_scale: float | None = None, rope_scale: float | None = None,
                                rope_theta: float | None = None, return_lse: bool = False):
    """Decode one query (q [num_qo_heads, head_dim]) against a contiguous KV: k/v are
    [kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND).

    Runs the batch kernel with the KV viewed as kv_len pages of one token, so split-KV spreads a
    long context over the whole GPU."""
    if is_compiling():
        return compile_ops.single_decode(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale,
                                         v_scale, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                         return_lse)
    # Metadata checks first: a CPU tensor is named here, before any CUDA work.
    kv_len, num_kv_heads = kv_cache.check_single(q, k, v, 2, kv_layout)
    if k.shape != v.shape:
        raise ValueError(f"k, v: expected equal shapes, got {tuple(k.shape)} and {tuple(v.shape)}")
    token_dim, head_dim_axis = (0, 1) if kv_layout == "NHD" else (1, 0)
    head_dim = k.shape[2]

    def as_pages(x: torch.Tensor) -> torch.Tensor:
        # [kv_len pages, 1 token, heads, head_dim], whatever the source layout.
        t, h = x.stride(token_dim), x.stride(head_dim_axis)
        return x.as_strided((kv_len, 1, num_kv_heads, head_dim), (t, t, h, x.stride(2)))

    device = q.device
    needed = decode.decode_workspace_size(1, q.shape[0], num_kv_heads, head_dim, device)
    workspace = _single_workspaces.get(device)
    if workspace is None or workspace.numel() < needed:
        workspace = _single_workspaces[device] = torch.empty(needed, dtype=torch.uint8, device=device)
    wrapper = decode.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
    wrapper.plan(
        torch.tensor([0, kv_len], dtype=torch.int32), torch.arange(kv_len, dtype=torch.int32, device=device),
        torch.tensor([1 if kv_len else 0], dtype=torch.int32), q.shape[0], num_kv_heads, head_dim, 1,
        pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
        q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
    result = wrapper.run(q.unsqueeze(0), (as_pages(k), as_pages(v)), q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, return_lse=return_lse)
    if return_lse:
        return result[0].squeeze(0), result[1].squeeze(0)
    return result.squeeze(0)
