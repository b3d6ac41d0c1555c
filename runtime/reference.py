"""attnforge.reference: the correctness oracle for decode attention.

Pure torch, fp32 math, CPU or GPU. Every kernel test compares against these functions, so
they favour obviously-right over fast: one request at a time, all of its keys at once (no
loop over tokens). They accept the same arguments and cache layouts as the kernels.

Conventions (FlashInfer's):
- scores s_j = (q . k_j) * sm_scale, sm_scale defaulting to 1/sqrt(head_dim);
- logits soft cap c > 0: s_j = c * tanh(s_j / c), applied before the softmax;
- sliding window window_left = w >= 0: the decode query sits at position kv_len - 1 and
  sees keys at positions >= kv_len - 1 - w (w + 1 keys at most); w = -1 means no window;
- GQA: query head h reads kv head h // (num_qo_heads // num_kv_heads);
- LSE is BASE 2: lse = log2(sum_j exp(s_j)) = logsumexp(s) / ln 2, the form that
  `attnforge.merge` and FlashInfer's merge_state consume;
- a request with no keys (0 pages) has o = 0 and lse = -inf.

Paged KV cache (FlashInfer's layout): request i owns pages indices[indptr[i]:indptr[i+1]]
and kv_len(i) = (num_pages - 1) * page_size + last_page_len[i] (0 when it has no pages).
The cache is a tuple (k_cache, v_cache), each NHD [num_pages, page_size, Hkv, D] or HND
[num_pages, Hkv, page_size, D], or one tensor [num_pages, 2, ...] whose axis 1 is (K, V).
"""

from __future__ import annotations

import math

import torch

__all__ = ["batch_decode_paged", "single_decode", "gather_dense_kv", "kv_lengths"]

_LN2 = math.log(2.0)
_LAYOUTS = ("NHD", "HND")


def _check_layout(kv_layout: str) -> None:
    if kv_layout not in _LAYOUTS:
        raise ValueError(f"kv_layout must be one of {_LAYOUTS}, got {kv_layout!r}")


def _pages_nhd(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the cache into K and V pages, both viewed as NHD [num_pages, page_size, Hkv, D]."""
    _check_layout(kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache tuple must be (k_cache, v_cache), got {len(paged_kv_cache)} items")
        k, v = paged_kv_cache
    else:
        if paged_kv_cache.dim() not in (4, 5) or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                "a single-tensor paged_kv_cache must be [num_pages, 2, ...] with 4 or 5 dims, "
                f"got shape {tuple(paged_kv_cache.shape)}"
            )
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if k.shape != v.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.dim() == 3:  # FlashInfer treats a 3-D page tensor as page_size = 1
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    if k.dim() != 4:
        raise ValueError(f"k_cache must have 4 dims (or 3 for page_size 1), got shape {tuple(k.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def kv_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
    """Per-request kv lengths in tokens; a request with no pages has length 0."""
    pages = (indptr[1:] - indptr[:-1]).tolist()
    last = last_page_len.tolist()
    return [0 if n == 0 else (n - 1) * page_size + l for n, l in zip(pages, last)]


def gather_dense_kv(paged_kv_cache, indptr, indices, last_page_len, kv_layout: str = "NHD"):
    """Per-request contiguous K and V: two lists of [kv_len_i, Hkv, D] tensors.

    Dtype and device are the cache's. Used by the reference itself and by benchmarks and
    tests that need the same contents as a dense cache.
    """
    k_pages, v_pages = _pages_nhd(paged_kv_cache, kv_layout)
    page_size = k_pages.shape[1]
    lens = kv_lengths(indptr, last_page_len, page_size)
    bounds = indptr.tolist()
    page_ids = indices.to(device=k_pages.device, dtype=torch.long)
    ks, vs = [], []
    for i, kv_len in enumerate(lens):
        pages = page_ids[bounds[i] : bounds[i + 1]]
        # [pages, page_size, Hkv, D] -> [pages * page_size, Hkv, D], then drop the unused tail
        ks.append(k_pages[pages].flatten(0, 1)[:kv_len])
        vs.append(v_pages[pages].flatten(0, 1)[:kv_len])
    return ks, vs


def _attend(q, k, v, *, window_left, logits_soft_cap, sm_scale):
    """One request: q [Hq, D], k/v [L, Hkv, D] -> (o [Hq, D] fp32, lse [Hq] fp32 base 2)."""
    num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if kv_len == 0:
        o = torch.zeros(num_qo_heads, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((num_qo_heads,), -math.inf, dtype=torch.float32, device=q.device)
        return o, lse
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    group = num_qo_heads // num_kv_heads
    # query head h = kv * group + j reads kv head kv = h // group, the GQA convention
    qg = q.float().reshape(num_kv_heads, group, head_dim)
    s = torch.einsum("kgd,lkd->kgl", qg, k.float()).reshape(num_qo_heads, kv_len) * scale  # [Hq, L]
    if logits_soft_cap is not None and logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    if window_left is not None and window_left >= 0:
        pos = torch.arange(kv_len, device=s.device)
        s = s.masked_fill(pos < kv_len - 1 - window_left, -math.inf)  # the last key always stays
    lse_e = torch.logsumexp(s, dim=-1)  # [Hq], natural log
    p = torch.exp(s - lse_e[:, None])
    o = torch.einsum("kgl,lkd->kgd", p.view(num_kv_heads, group, kv_len), v.float()).reshape(num_qo_heads, -1)
    return o, lse_e / _LN2


def single_decode(q, k, v, *, kv_layout: str = "NHD", window_left: int = -1, logits_soft_cap=None, sm_scale=None):
    """Decode one query against a contiguous cache.

    q [Hq, D]; k, v NHD [kv_len, Hkv, D] or HND [Hkv, kv_len, D].
    Returns (o [Hq, D] fp32, lse [Hq] fp32, base 2).
    """
    _check_layout(kv_layout)
    if q.dim() != 2 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected q [Hq, D] and k/v 3-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    return _attend(q, k, v, window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)


def batch_decode_paged(
    q,
    paged_kv_cache,
    indptr,
    indices,
    last_page_len,
    *,
    kv_layout: str = "NHD",
    window_left: int = -1,
    logits_soft_cap=None,
    sm_scale=None,
):
    """Decode a batch against a paged cache (FlashInfer's BatchDecode semantics).

    q [B, Hq, D]; indptr [B + 1], indices [indptr[-1]], last_page_len [B] (any device).
    Returns (o [B, Hq, D] fp32, lse [B, Hq] fp32, base 2) on q's device.
    """
    batch_size = q.shape[0]
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    if indptr.numel() != batch_size + 1 or last_page_len.numel() != batch_size:
        raise ValueError(
            f"batch of {batch_size} needs indptr [{batch_size + 1}] and last_page_len [{batch_size}], "
            f"got {tuple(indptr.shape)} and {tuple(last_page_len.shape)}"
        )
    ks, vs = gather_dense_kv(paged_kv_cache, indptr.cpu(), indices, last_page_len.cpu(), kv_layout)
    outs, lses = [], []
    for i in range(batch_size):
        o, lse = _attend(
            q[i], ks[i].to(q.device), vs[i].to(q.device),
            window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
        )
        outs.append(o)
        lses.append(lse)
    if batch_size == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_zeros((0, q.shape[1]), dtype=torch.float32)
    return torch.stack(outs), torch.stack(lses)
