"""KV cache tensors as the kernels see them: split into K and V, checked against the plan, and
reduced to element strides. Shared by every wrapper that reads a paged or ragged cache."""

from __future__ import annotations

import torch

from . import checks

KV_LAYOUTS = ("NHD", "HND")


def check_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


def split_pages(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of a (k, v) tuple or a single [num_pages, 2, ...] tensor, each a 4-D page array."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache: expected a (k_cache, v_cache) pair, got {len(paged_kv_cache)} tensors")
        k_cache, v_cache = paged_kv_cache
        checks.tensor(k_cache, "paged_kv_cache[0] (k_cache)")
        checks.tensor(v_cache, "paged_kv_cache[1] (v_cache)")
    else:
        checks.tensor(paged_kv_cache, "paged_kv_cache")
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"paged_kv_cache: a single tensor must be [num_pages, 2, ...] ({kv_layout} pages "
                             f"after the K/V axis), got shape {tuple(paged_kv_cache.shape)}")
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    layout = ("[num_pages, page_size, num_kv_heads, head_dim]" if kv_layout == "NHD"
              else "[num_pages, num_kv_heads, page_size, head_dim]")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D {kv_layout} cache {layout}, got shape {tuple(cache.shape)}")
    return k_cache, v_cache


def split_paged(paged_kv_cache, kv_layout: str, page_size: int, num_kv_heads: int, head_dim_qk: int,
                head_dim_vo: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of a tuple or single-tensor paged cache, each checked to be a 4-D page
    array of the planned shape, dtype and device, both with the same number of pages."""
    k_cache, v_cache = split_pages(paged_kv_cache, kv_layout)
    per_page = (page_size, num_kv_heads) if kv_layout == "NHD" else (num_kv_heads, page_size)
    layout = ("[num_pages, page_size, num_kv_heads, head_dim]" if kv_layout == "NHD"
              else "[num_pages, num_kv_heads, page_size, head_dim]")
    for name, cache, head_dim in (("k_cache", k_cache, head_dim_qk), ("v_cache", v_cache, head_dim_vo)):
        checks.planned_tensor(cache, name, (cache.shape[0], *per_page, head_dim), f"{kv_layout}: {layout}",
                              planned_dtype=dtype, dtype_arg="kv_data_type", on=device)
    if k_cache.shape[0] != v_cache.shape[0]:
        raise ValueError(f"paged_kv_cache: k and v caches must hold the same number of pages, got "
                         f"{k_cache.shape[0]} and {v_cache.shape[0]}")
    # Checked once per cache form (run_args.Accepted), so run()'s steady state pays nothing for it.
    checks.int_in(k_cache.shape[0], "paged_kv_cache pages", 0, checks.INT32_MAX, "num_pages, an int32 field of the kernel")
    return k_cache, v_cache


def paged_strides(cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int]:
    """(page, token, head) strides in elements of a 4-D page array."""
    if kv_layout == "NHD":
        return cache.stride(0), cache.stride(1), cache.stride(2)
    return cache.stride(0), cache.stride(2), cache.stride(1)


def check_ragged(x: torch.Tensor, name: str, kv_layout: str, num_tokens: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
    """Ragged k or v (argument `name`): [tokens, heads, head_dim] (NHD), or heads first (HND), with the
    planned sizes, dtype and device."""
    layout = ("[kv_indptr[-1], num_kv_heads, head_dim]" if kv_layout == "NHD"
              else "[num_kv_heads, kv_indptr[-1], head_dim]")
    expected = (num_tokens, num_kv_heads, head_dim) if kv_layout == "NHD" else (num_kv_heads, num_tokens, head_dim)
    checks.planned_tensor(x, name, expected, layout, planned_dtype=dtype, dtype_arg="kv_data_type", on=device)


def kv_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each request's kv tokens, (pages - 1) * page_size + last_page_len, as int64 (no int32 wrap
    before the planner's bounds check); a request with no pages holds 0 (unlike FlashInfer's
    page.get_seq_lens, which reports its last_page_len)."""
    pages = (indptr[1:] - indptr[:-1]).long()
    return torch.where(pages > 0, (pages - 1) * page_size + last_page_len.long(), 0)


def ragged_strides(k: torch.Tensor, kv_layout: str) -> tuple[int, int]:
    """(token, head) strides in elements of a ragged K or V."""
    return (k.stride(0), k.stride(1)) if kv_layout == "NHD" else (k.stride(1), k.stride(0))


def check_page_ids(indices, name: str) -> None:
    checks.tensor(indices, name)
    checks.dtype(indices, name, torch.int32)
    if indices.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of page ids, got shape {tuple(indices.shape)}")
    checks.int_in(indices.numel(), f"{name} entries", 0, checks.INT32_MAX, "num_indices, an int32 field of the planner")


def stage_page_ids(indices: torch.Tensor, used: int, device: torch.device, name: str,
                   graph_buffer: torch.Tensor | None = None, buffer_name: str = "") -> tuple[torch.Tensor, int | None]:
    """Page ids on `device` — copied into `graph_buffer` under CUDA graphs, whose captured kernels
    read a fixed address — and the largest of the first `used` ids when the caller gave them on
    the host, where checking costs one pass over them (None for device ids)."""
    host_max = None
    if not indices.is_cuda:
        used_ids = indices[:used]
        host_max = -1
        if used_ids.numel() > 0:  # an indptr past the ids is the planner's error to report
            low, high = torch.aminmax(used_ids)
            if int(low) < 0:
                raise ValueError(f"{name}: page ids must be >= 0, got a negative id")
            host_max = int(high)
    elif indices.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the workspace's device), got {indices.device}")
    if graph_buffer is not None:
        if graph_buffer.numel() < indices.numel():
            raise ValueError(f"{buffer_name}: holds {graph_buffer.numel()} page ids, the plan needs {indices.numel()}")
        graph_buffer[: indices.numel()].copy_(indices, non_blocking=True)
        return graph_buffer, host_max
    if indices.is_cuda:  # already on the workspace's device: skip the no-op .to() dispatch
        return indices.contiguous(), host_max
    return indices.to(device, non_blocking=True).contiguous(), host_max


def check_single(q, k, v, q_dims: int, kv_layout: str) -> tuple[int, int]:
    """The single_* helpers' q ([qo_len,] num_qo_heads, head_dim_qk) and contiguous k/v
    ([kv_len, num_kv_heads, head_dim] NHD, heads first HND), checked from metadata alone before any
    CUDA work: tensors of the right rank on one CUDA device, k and v of one dtype, kv length and
    heads, q's head dim k's. Returns (kv_len, num_kv_heads)."""
    for name, x, dims in (("q", q, q_dims), ("k", k, 3), ("v", v, 3)):
        checks.tensor(x, name)
        if x.dim() != dims:
            raise ValueError(f"{name}: expected a {dims}-D tensor, got shape {tuple(x.shape)}")
    check_layout(kv_layout)
    checks.cuda_tensor(q, "q")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got one on {x.device}")
    if v.dtype != k.dtype:
        raise ValueError(f"v: expected k's dtype {k.dtype}, got {v.dtype}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k, v: expected the same kv length and heads ({kv_layout}), got shapes {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[2]:
        raise ValueError(f"q: expected head dim {k.shape[2]} (k's), got shape {tuple(q.shape)}")
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    # kv_len becomes an int32 kv_indptr entry (single decode: a page count, one token per page).
    checks.int_in(kv_len, "k", 0, checks.INT32_MAX, f"kv length ({kv_layout}); int32 in the plan")
    if q_dims == 3:  # qo_indptr is int32 too
        checks.int_in(q.shape[0], "q", 0, checks.INT32_MAX, "query tokens; int32 in the plan")
    return kv_len, num_kv_heads
