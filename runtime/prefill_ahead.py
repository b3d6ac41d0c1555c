"""Work an fa3 prefill run may do once, before its kernel, instead of in every q tile that reads a
key: the plan's pages gathered into ragged K and V (paged plans), and V transposed (fp8). Each
pays only when the requests' keys are read by many q tiles; these functions decide from the plan's
lengths, on the host."""

from __future__ import annotations

import torch

# fa3 fp8: keys per block of V transposed ahead (the kernels' kv tile).
VT_BLOCK_KEYS = 128

# Pages gathered ahead when each key is read by at least this many packed query rows on average.
# The copy reads and writes each key once: against a kernel reading it at ~600 bf16 TFLOP/s, a pass
# at the 4.26 TB/s copy rate costs about 280 / reads of the kernel's time (4.6% here; fp8 and hd 64
# less), where the ragged kernel saves the paged one's 6-15% (page ids, one TMA box per page and
# column block, 64-key tiles at hd 256): 4 x 4096 gathers, causal too; 16 x 1024 (4096 reads) not.
GATHER_MIN_READS_PER_KEY = 6144
# The copy kernel counts a tensor's 16-byte chunks in int32.
GATHER_MAX_BYTES = 1 << 35


def transposed_v_blocks(qo_lens: torch.Tensor, kv_lens: torch.Tensor, group: int, tile: int) -> torch.Tensor | None:
    """fa3 fp8 prefill: each request's first block of V transposed ahead ([batch+1] int32 prefix of
    VT_BLOCK_KEYS-key blocks, none for a request no query reads), or None when the requests that read
    keys average fewer than two q tiles each: V is then read about once, and a pass that transposes it
    costs more than the kernel's own transposes."""
    tiles = (qo_lens.to(torch.int64) * group + tile - 1) // tile
    reading = (kv_lens > 0) & (tiles > 0)
    readers = int(reading.sum())
    if readers == 0 or int(tiles[reading].sum()) < 2 * readers:
        return None
    blocks = torch.where(reading, (kv_lens.to(torch.int64) + VT_BLOCK_KEYS - 1) // VT_BLOCK_KEYS, 0)
    first = torch.zeros(kv_lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(blocks, 0, out=first[1:])
    return first.to(torch.int32)


def reads_per_key(qo_lens: torch.Tensor, kv_lens: torch.Tensor, group: int, causal: bool, window_left: int) -> float:
    """Packed query rows that read a key, averaged over the batch's keys (0 for no keys). Causal rows
    see keys up to their position, bottom-right aligned; a window caps what each row sees."""
    qo, kv = qo_lens.to(torch.int64), kv_lens.to(torch.int64)
    if int(kv.sum()) == 0:
        return 0.0
    if causal:
        pairs = torch.where(qo <= kv, qo * kv - qo * (qo - 1) // 2, kv * (kv + 1) // 2)
    else:
        pairs = qo * kv
    if window_left >= 0:
        pairs = torch.minimum(pairs, qo * (window_left + 1))
    return group * int(pairs.sum()) / int(kv.sum())


def gathers_pages(qo_lens: torch.Tensor, kv_lens: torch.Tensor, group: int, causal: bool, window_left: int) -> bool:
    """fa3 paged prefill: whether the plan's pages are worth copying into ragged K and V first."""
    if group * int(qo_lens.sum()) < GATHER_MIN_READS_PER_KEY:  # no key is read by more rows than there are
        return False
    return reads_per_key(qo_lens, kv_lens, group, causal, window_left) >= GATHER_MIN_READS_PER_KEY


def gathered_kv_bytes(rows: int, num_kv_heads: int, head_dims: int, element_bytes: int) -> int:
    """Workspace bytes of the gathered K and V (head_dims: head_dim_qk + head_dim_vo), 1024-aligned
    so V^T after them keeps its alignment."""
    return -(-rows * num_kv_heads * head_dims * element_bytes // 1024) * 1024


def gathered_rows(page_indptr: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each request's first row among the gathered pages ([batch+1] int32): the pages are copied in
    page-table order from page_indptr[0] on, a request's partial last page whole."""
    return ((page_indptr.to(torch.int64) - int(page_indptr[0])) * page_size).to(torch.int32)
