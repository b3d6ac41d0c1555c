"""The decode benchmarks' problem: one paged KV cache (pages scattered over a pool at random) and the
same contents as a dense cache for SDPA, with the query; the acceptance shape's constants (bf16 q,
32 query / 8 kv heads, head dim 128, page 16); and the device memory a problem needs at its peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_QO_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 16
DTYPE = torch.bfloat16
# The tensor-core paths' float workspace (ours and FlashInfer's): split-KV partials by batch x heads x tile
PEER_WORKSPACE = 512 << 20
# make_problem's peak: the dense K and V, the cache of one while the other is paged (its padded copy, its
# pages, the random pool); plus PEER_WORKSPACE and 1 GiB for the kernels' and peers' own buffers
PEAK_KV_COPIES = 5
SPARE_BYTES = PEER_WORKSPACE + (1 << 30)


@dataclass
class Problem:
    q: torch.Tensor  # [B, Hq, D]
    cache: tuple  # (k, v) paged, NHD [P, page, Hkv, D] or HND [P, Hkv, page, D], in the kv dtype
    indptr: torch.Tensor  # [B + 1] int32 host
    indices: torch.Tensor  # int32 device, a random subset of the pool
    last_page_len: torch.Tensor  # [B] int32 host
    dense_k: torch.Tensor  # [B, Hkv, L, D] bf16, what SDPA reads: the cache's values
    dense_v: torch.Tensor

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cache[0].dtype

    @property
    def bytes_moved(self) -> int:
        kv_bytes = self.cache[0].element_size() * (self.dense_k.numel() + self.dense_v.numel())
        return self.q.element_size() * 2 * self.q.numel() + kv_bytes


def page_table(batch: int, kv_len: int, pool_pages: int, gen):
    pages = math.ceil(kv_len / PAGE_SIZE)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    indices = torch.randperm(pool_pages, generator=gen)[: batch * pages].to(torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * PAGE_SIZE, dtype=torch.int32)
    return indptr, indices.cuda(), last


def to_pages(dense: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B * pages, page, Hkv, D] (NHD) or [B * pages, Hkv, page, D] (HND)."""
    b, h, length, d = dense.shape
    pages = math.ceil(length / PAGE_SIZE)
    padded = F.pad(dense, (0, 0, 0, pages * PAGE_SIZE - length)).view(b, h, pages, PAGE_SIZE, d)
    by_page = padded.permute(0, 2, 3, 1, 4) if layout == "NHD" else padded.permute(0, 2, 1, 3, 4)
    return by_page.reshape(b * pages, *by_page.shape[2:])  # copies: the pages become contiguous


def make_problem(batch: int, kv_len: int, layout: str, kv_dtype: torch.dtype = DTYPE, seed: int = 0,
                 head_dim: int = HEAD_DIM) -> Problem:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # rounded through the kv dtype, so the bf16 dense copy holds exactly the cache's values
    dense_k, dense_v = (
        torch.randn(batch, NUM_KV_HEADS, kv_len, head_dim, dtype=DTYPE, device="cuda", generator=gen)
        .to(kv_dtype).to(DTYPE)
        for _ in "kv"
    )
    pool = batch * math.ceil(kv_len / PAGE_SIZE) + 64  # spare pages, so the table is a true subset
    indptr, indices, last = page_table(batch, kv_len, pool, torch.Generator().manual_seed(seed))
    cache = []
    for dense in (dense_k, dense_v):
        pages = to_pages(dense, layout)
        paged = torch.randn(pool, *pages.shape[1:], dtype=DTYPE, device="cuda", generator=gen)
        paged.index_copy_(0, indices.long(), pages)
        del pages
        cache.append(paged.to(kv_dtype))  # exact: the pages hold kv_dtype values already
    q = torch.randn(batch, NUM_QO_HEADS, head_dim, dtype=DTYPE, device="cuda", generator=gen)
    return Problem(q, tuple(cache), indptr, indices, last, dense_k, dense_v)


def problem_bytes(batch: int, kv_len: int, head_dim: int) -> int:
    """Device memory a row needs at its peak (make_problem's), with room for the workspaces."""
    one_kv = batch * NUM_KV_HEADS * math.ceil(kv_len / PAGE_SIZE) * PAGE_SIZE * head_dim * DTYPE.itemsize
    return PEAK_KV_COPIES * one_kv + SPARE_BYTES
