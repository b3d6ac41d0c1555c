"""attnforge.page: FlashInfer's paged-KV helpers, at FlashInfer's path and with its signatures.

    get_seq_lens                 kv lengths from (kv_indptr, kv_last_page_len, page_size)
    get_batch_indices_positions  each appended token's request and position in that request's KV
    append_paged_kv_cache        scatter appended K/V tokens into their pages (NHD or HND)

All three are tensor ops on the tensors' device with no host synchronisation, so they run inside
CUDA graphs. append_paged_kv_cache computes every token's (page, slot) at once and writes K and V
with one index_put_ each: no Python loop per token.
"""

from __future__ import annotations

import torch

from . import checks, kv_cache

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """kv length of each request: (pages - 1) * page_size + last_page_len, with pages - 1 clamped
    at 0 (so a request with no pages reports its last_page_len, as FlashInfer's does)."""
    checks.tensor(kv_indptr, "kv_indptr")
    checks.tensor(kv_last_page_len, "kv_last_page_len")
    checks.positive_int(page_size, "page_size", why="the int32 lengths are pages times page_size")
    if kv_last_page_len.shape != (kv_indptr.numel() - 1,):
        raise ValueError(f"kv_last_page_len: expected shape ({kv_indptr.numel() - 1},) (batch_size, one less than "
                         f"kv_indptr), got {tuple(kv_last_page_len.shape)}")
    return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len


def _output(buffer, name: str, nnz: int, device: torch.device) -> torch.Tensor | None:
    if buffer is None:
        return None
    checks.tensor(buffer, name)
    checks.dtype(buffer, name, torch.int32)
    checks.device(buffer, name, device)
    checks.shape(buffer, name, (nnz,), "[nnz]")
    return buffer


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int,
                                batch_indices: torch.Tensor | None = None,
                                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch_indices, positions), int32 [nnz] on append_indptr's device: entry i of the ragged
    append belongs to the request b with append_indptr[b] <= i < append_indptr[b+1] and lands at
    position seq_lens[b] - append_len[b] + (i - append_indptr[b]) of its KV (seq_lens already count
    the appended tokens). Entries at or past append_indptr[-1] get batch index -1 and position 0."""
    checks.tensor(append_indptr, "append_indptr")
    checks.tensor(seq_lens, "seq_lens")
    checks.int_in(nnz, "nnz", 0, checks.INT32_MAX, "entries of the int32 batch_indices and positions")
    if append_indptr.dim() != 1 or seq_lens.shape != (append_indptr.numel() - 1,):
        raise ValueError(f"seq_lens: expected shape (batch_size,) = ({append_indptr.numel() - 1},) for append_indptr "
                         f"of shape {tuple(append_indptr.shape)}, got {tuple(seq_lens.shape)}")
    device = append_indptr.device
    batch_indices = _output(batch_indices, "batch_indices", nnz, device)
    positions = _output(positions, "positions", nnz, device)
    entry = torch.arange(nnz, dtype=torch.int64, device=device)
    starts = append_indptr.to(torch.int64)
    # request of each entry: how many request ends lie at or before it
    batch = torch.searchsorted(starts[1:], entry, right=True)
    inside = batch < starts.numel() - 1
    safe = torch.where(inside, batch, torch.zeros_like(batch))
    ends = seq_lens.to(device=device, dtype=torch.int64)
    position = ends[safe] - (starts[safe + 1] - entry)
    batch_out = torch.where(inside, batch, torch.full_like(batch, -1)).to(torch.int32)
    position_out = torch.where(inside, position, torch.zeros_like(position)).to(torch.int32)
    if batch_indices is None:
        return batch_out, position_out
    batch_indices.copy_(batch_out)
    positions.copy_(position_out)
    return batch_indices, positions


def _check_append(name: str, x, like_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    checks.tensor(x, name)
    if x.dim() != 3 or tuple(x.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"{name}: expected shape [nnz, {num_kv_heads}, {head_dim}] (the cache's heads and head_dim), "
                         f"got {tuple(x.shape)}")
    checks.dtype(x, name, like_cache.dtype, "the paged cache's dtype")
    checks.device(x, name, like_cache.device)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                          positions: torch.Tensor, paged_kv_cache, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Write append_key/append_value [nnz, num_kv_heads, head_dim] into the paged cache: entry i goes
    to token positions[i] of request batch_indices[i], i.e. page kv_indices[kv_indptr[b] +
    positions[i] // page_size], slot positions[i] % page_size. The page table must already
    include the appended tokens (FlashInfer's contract). Entries with a negative batch index
    (get_batch_indices_positions' padding) are skipped. kv_last_page_len is taken for FlashInfer's
    signature; the positions already say where each token goes."""
    kv_cache.check_layout(kv_layout)
    k_cache, v_cache = kv_cache.split_pages(paged_kv_cache, kv_layout)
    page_axis = 1 if kv_layout == "NHD" else 2
    page_size, num_kv_heads = k_cache.shape[page_axis], k_cache.shape[3 - page_axis]
    _check_append("append_key", append_key, k_cache, num_kv_heads, k_cache.shape[3])
    _check_append("append_value", append_value, v_cache, num_kv_heads, v_cache.shape[3])
    nnz = append_key.shape[0]
    for name, x in (("append_value", append_value), ("batch_indices", batch_indices), ("positions", positions)):
        checks.tensor(x, name)
        if x.shape[0] != nnz or (x.dim() != 1 and name != "append_value"):
            raise ValueError(f"{name}: expected {nnz} entries (one per row of append_key), got shape {tuple(x.shape)}")
    for name, x in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len)):
        checks.tensor(x, name)
        if x.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if nnz == 0:
        return
    if kv_indices.numel() == 0:
        raise ValueError(f"kv_indices: empty, but {nnz} tokens are appended; the page table must already hold "
                         "their pages")
    device = k_cache.device
    batch = batch_indices.to(device=device, dtype=torch.int64)
    valid = batch >= 0
    # Padding entries copy the first real entry (the same bytes to the same slot, so the duplicate
    # write is harmless); when there is none, they rewrite a slot with its own contents.
    first = valid.to(torch.int32).argmax()
    rows = torch.where(valid, torch.arange(nnz, device=device), first)
    request = batch[rows].clamp_min(0)
    position = positions.to(device=device, dtype=torch.int64)[rows]
    page_slot = kv_indptr.to(device=device, dtype=torch.int64)[request] + torch.div(position, page_size,
                                                                                    rounding_mode="floor")
    page = kv_indices.to(device=device, dtype=torch.int64)[page_slot.clamp(0, kv_indices.numel() - 1)]
    slot = position % page_size
    any_valid = valid.any()  # a tensor: indexing valid by `first` would read it on the host
    for cache, values in ((k_cache, append_key), (v_cache, append_value)):
        by_token = cache if kv_layout == "NHD" else cache.transpose(1, 2)  # [pages, page_size, heads, dim] view
        current = by_token[page, slot]
        by_token.index_put_((page, slot), torch.where(any_valid, values[rows], current))
