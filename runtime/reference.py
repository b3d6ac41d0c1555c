"""attnforge.reference: the correctness oracle for decode and prefill attention.

Pure torch, fp32 math, CPU or GPU. Every kernel test compares against these functions, so
they favour obviously-right over fast: one request at a time, all of its keys at once (no
loop over tokens; a request costs Hq * qo_len * kv_len floats of scores). They accept the
same arguments and cache layouts as the kernels.

Conventions (FlashInfer's):
- request r has qo_len query tokens and kv_len keys; query token t sits at position
  q_pos = t + kv_len - qo_len (bottom-right aligned: the last query is at the last key), key j
  at position j. A decode query is the qo_len = 1 case, at position kv_len - 1;
- scores s_j = (q . k_j) * sm_scale, sm_scale defaulting to 1/sqrt(head_dim_qk); ALiBi adds
  slope_h * (j - q_pos); a logits soft cap c > 0 then gives s_j = c * tanh(s_j / c); then the
  softmax over the visible keys;
- visible keys: all (non-causal), j <= q_pos (causal), or the request's custom mask, which
  replaces causal; a sliding window window_left = w >= 0 further hides j < q_pos - w (so a
  decode query sees w + 1 keys at most); w = -1 means no window;
- ROPE_LLAMA rotates q at q_pos and k at j, pairing dims i and i + D/2, angle
  pos * rope_theta^(-2i/D) / rope_scale (defaults rope_scale 1, rope_theta 1e4);
- GQA: query head h reads kv head h // (num_qo_heads // num_kv_heads);
- LSE is BASE 2: lse = log2(sum_j exp(s_j)) = logsumexp(s) / ln 2, the form that
  `attnforge.merge` and FlashInfer's merge_state consume;
- a query row that sees no key (an empty request, or causal with qo_len > kv_len) has o = 0
  and lse = -inf;
- attention sinks (gpt-oss, FlashInfer's run(sinks=)): sinks [Hq] fp32 holds one logit per query
  head, in the units of the scaled logits s_j (natural log, not multiplied by sm_scale). It is an
  extra key with no value: o = sum_j exp(s_j) v_j / (exp(sink_h) + sum_j exp(s_j)), and the lse
  (base 2) counts it. A row that sees no key then has o = 0 and lse = sink_h / ln 2.

Paged KV cache (FlashInfer's layout): request i owns pages indices[indptr[i]:indptr[i+1]]
and kv_len(i) = (num_pages - 1) * page_size + last_page_len[i] (0 when it has no pages).
The cache is a tuple (k_cache, v_cache), each NHD [num_pages, page_size, Hkv, D] or HND
[num_pages, Hkv, page_size, D], or one tensor [num_pages, 2, ...] whose axis 1 is (K, V).
A ragged cache is k [total_kv, Hkv, Dqk], v [total_kv, Hkv, Dvo] (NHD; HND puts heads first)
with request i owning tokens kv_indptr[i]:kv_indptr[i+1].

Custom masks for a batch arrive bit-packed as FlashInfer's kernels read them: request i's
[qo_len, kv_len] mask, row-major, little-endian bits, from byte mask_indptr[i] (the layout
`attnforge.segment_packbits(..., bitorder="little")` produces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnforge.codegen.spec import PosEncoding

from . import checks, kv_cache
from .dispatch import parse_pos_encoding
from .mask import unpackbits

__all__ = [
    "alibi_slopes",
    "batch_decode_paged",
    "batch_prefill_paged",
    "batch_prefill_ragged",
    "gather_dense_kv",
    "kv_lengths",
    "single_decode",
    "single_prefill",
]

_LN2 = math.log(2.0)
_LAYOUTS = ("NHD", "HND")


def _check_layout(kv_layout: str) -> None:
    if kv_layout not in _LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {_LAYOUTS}, got {kv_layout!r}")


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
    if k.shape[:-1] != v.shape[:-1]:  # only the head dims may differ (head_dim_qk vs head_dim_vo)
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.dim() == 3:  # FlashInfer treats a 3-D page tensor as page_size = 1
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    if k.dim() != 4:
        raise ValueError(f"k_cache must have 4 dims (or 3 for page_size 1), got shape {tuple(k.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def kv_lengths(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
    """Per-request kv lengths in tokens; a request with no pages has length 0 (the runtime's rule,
    kv_cache.kv_lengths)."""
    return kv_cache.kv_lengths(indptr.cpu(), last_page_len.cpu(), page_size).tolist()


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
    used = page_ids[: bounds[-1]]
    if used.numel() and not 0 <= int(used.min()) <= int(used.max()) < k_pages.shape[0]:
        raise ValueError(f"indices: expected page ids in [0, {k_pages.shape[0]}) (the cache's pages), "
                         f"got ids from {int(used.min())} to {int(used.max())}")
    ks, vs = [], []
    for i, kv_len in enumerate(lens):
        pages = page_ids[bounds[i] : bounds[i + 1]]
        # [pages, page_size, Hkv, D] -> [pages * page_size, Hkv, D], then drop the unused tail
        ks.append(k_pages[pages].flatten(0, 1)[:kv_len])
        vs.append(v_pages[pages].flatten(0, 1)[:kv_len])
    return ks, vs


def _kv_nhd(k, v, kv_layout: str):
    """Contiguous k/v as NHD [kv_len, Hkv, D]; HND [Hkv, kv_len, D] is transposed."""
    _check_layout(kv_layout)
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"k, v: expected 3-D tensors ({kv_layout}), got shapes {tuple(k.shape)} and {tuple(v.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"v: expected the tokens and heads of k {tuple(k.shape[:2])}, got {tuple(v.shape[:2])}")
    return k, v


# ---------------------------------------------------------------------------------------
# attention options and positional encodings


@dataclass(frozen=True)
class _Options:
    """What every request of one call shares, checked once."""

    causal: bool = False
    window_left: int = -1
    sm_scale: float | None = None  # None: 1 / sqrt(head_dim_qk)
    soft_cap: float = 0.0  # 0: no soft cap
    pos_encoding: PosEncoding = PosEncoding.NONE
    rope_scale: float = 1.0
    rope_theta: float = 1e4


def _positive(value, name: str, default=None):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}: expected None or a positive finite float, got {value!r}")
    return float(value)


def _options(*, causal=False, window_left=-1, sm_scale=None, logits_soft_cap=None, pos_encoding_mode="NONE",
             rope_scale=None, rope_theta=None) -> _Options:
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    if window_left is None:
        window_left = -1
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or a non-negative int, got {window_left!r}")
    if logits_soft_cap is not None and logits_soft_cap != 0:  # None and 0 both mean no cap, as in FlashInfer
        _positive(logits_soft_cap, "logits_soft_cap")
    return _Options(
        causal=causal,
        window_left=window_left,
        sm_scale=_positive(sm_scale, "sm_scale"),
        soft_cap=float(logits_soft_cap or 0.0),
        pos_encoding=parse_pos_encoding(pos_encoding_mode),
        rope_scale=_positive(rope_scale, "rope_scale", 1.0),
        rope_theta=_positive(rope_theta, "rope_theta", 1e4),
    )


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes, fp32 [num_heads] on the CPU, as FlashInfer's get_alibi_slopes.

    The first n heads, n the largest power of two <= num_heads, take the ALiBi paper's
    geometric sequence 2^(-8k/n), k = 1..n. Any further heads take the slopes that fall
    between those, 2^(-4k/n) for odd k = 1, 3, 5, ... (every other slope of a 2n-head model).
    """
    checks.positive_int(num_heads, "num_heads")
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def _rope(x: torch.Tensor, positions: torch.Tensor, opts: _Options) -> torch.Tensor:
    """ROPE_LLAMA on fp32 x [L, H, D] at positions [L]: dims (i, i + D/2) rotate together."""
    half = x.shape[-1] // 2
    # angles in float64 so the oracle stays exact at long positions, where the kernels' fp32 is not
    freq = opts.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / x.shape[-1])
    angle = positions.to(torch.float64)[:, None] * freq / opts.rope_scale  # [L, D/2]
    cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)


# ---------------------------------------------------------------------------------------
# requests


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, opts: _Options, custom_mask) -> torch.Tensor:
    """bool [qo_len, kv_len]: which keys each query row sees."""
    rel = k_pos[None, :] - q_pos[:, None]  # j - q_pos
    if custom_mask is not None:
        visible = custom_mask.to(device=rel.device, dtype=torch.bool)
    elif opts.causal:
        visible = rel <= 0
    else:
        visible = torch.ones_like(rel, dtype=torch.bool)
    if opts.window_left >= 0:
        visible = visible & (rel >= -opts.window_left)
    return visible


def _sinks(sinks, num_qo_heads: int):
    """sinks as fp32 [num_qo_heads], or None."""
    if sinks is None:
        return None
    checks.tensor(sinks, "sinks")
    if not sinks.is_floating_point() or tuple(sinks.shape) != (num_qo_heads,):
        raise ValueError(f"sinks: expected a float tensor of shape ({num_qo_heads},) (one logit per query head), "
                         f"got {sinks.dtype} of shape {tuple(sinks.shape)}")
    return sinks.float()


def _attend(q, k, v, opts: _Options, custom_mask=None, sinks=None):
    """One request: q [qo_len, Hq, Dqk], k [kv_len, Hkv, Dqk], v [kv_len, Hkv, Dvo], all on one
    device; custom_mask bool [qo_len, kv_len] or None; sinks fp32 [Hq] or None.
    Returns (o [qo_len, Hq, Dvo] fp32, lse [qo_len, Hq] fp32 base 2)."""
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"q: expected num_qo_heads to be a multiple of num_kv_heads ({num_kv_heads}, k's heads), "
                         f"got {num_qo_heads}")
    group = num_qo_heads // num_kv_heads
    q_pos = torch.arange(qo_len, device=q.device) + (kv_len - qo_len)
    k_pos = torch.arange(kv_len, device=q.device)
    qf, kf = q.float(), k.float()
    if opts.pos_encoding is PosEncoding.ROPE_LLAMA:
        if head_dim % 2:
            raise ValueError(f"q: ROPE_LLAMA rotates pairs of dims, so head_dim_qk must be even, got {head_dim}")
        qf, kf = _rope(qf, q_pos, opts), _rope(kf, k_pos, opts)
    scale = 1.0 / math.sqrt(head_dim) if opts.sm_scale is None else opts.sm_scale
    # query head h = kv * group + g reads kv head kv = h // group, the GQA convention
    qg = qf.reshape(qo_len, num_kv_heads, group, head_dim)
    s = torch.einsum("tkgd,lkd->kgtl", qg, kf).reshape(num_qo_heads, qo_len, kv_len) * scale
    if opts.pos_encoding is PosEncoding.ALIBI:
        slopes = alibi_slopes(num_qo_heads).to(q.device)
        s = s + slopes[:, None, None] * (k_pos[None, :] - q_pos[:, None])
    if opts.soft_cap > 0:
        s = opts.soft_cap * torch.tanh(s / opts.soft_cap)
    s = s.masked_fill(~_visible(q_pos, k_pos, opts, custom_mask), -math.inf)
    if sinks is not None:  # the sink: one more logit column, whose weight multiplies no value
        s = torch.cat([s, sinks.to(s.device)[:, None, None].expand(num_qo_heads, qo_len, 1)], dim=-1)
    lse_e = torch.logsumexp(s, dim=-1)  # [Hq, qo_len], natural log; -inf for a row that sees nothing
    # such a row subtracts 0 instead of -inf, so its weights are exp(-inf) = 0 and its o is 0
    p = torch.exp(s - lse_e.masked_fill(lse_e.isneginf(), 0.0)[..., None])[..., :kv_len]
    o = torch.einsum("kgtl,lkd->tkgd", p.view(num_kv_heads, group, qo_len, kv_len), v.float())
    return o.reshape(qo_len, num_qo_heads, v.shape[-1]), (lse_e / _LN2).T


def _o_dtype(o_dtype, q) -> torch.dtype:
    if o_dtype is None:
        return q.dtype
    if not isinstance(o_dtype, torch.dtype) or not o_dtype.is_floating_point:
        raise ValueError(f"o_dtype: expected None (q's dtype) or a floating torch.dtype, got {o_dtype!r}")
    return o_dtype


def _attend_batch(q, qo_bounds: list[int], ks: list, vs: list, masks: list, opts: _Options, o_dtype: torch.dtype,
                  head_dim_vo: int, sinks=None):
    """Attend request i's rows qo_bounds[i]:qo_bounds[i + 1] of q [total_q, Hq, Dqk] to its own
    ks[i], vs[i], masks[i] (and every row to the sinks [Hq], if given).
    Returns (o [total_q, Hq, head_dim_vo] in o_dtype, lse [total_q, Hq] fp32)."""
    sinks = _sinks(sinks, q.shape[1])
    o = q.new_zeros((q.shape[0], q.shape[1], head_dim_vo), dtype=torch.float32)
    lse = q.new_zeros((q.shape[0], q.shape[1]), dtype=torch.float32)
    for i, (k, v, mask) in enumerate(zip(ks, vs, masks)):
        rows = slice(qo_bounds[i], qo_bounds[i + 1])
        o[rows], lse[rows] = _attend(q[rows], k.to(q.device), v.to(q.device), opts, mask, sinks)
    return o.to(o_dtype), lse


# ---------------------------------------------------------------------------------------
# decode


def single_decode(q, k, v, *, kv_layout: str = "NHD", window_left: int = -1, logits_soft_cap=None, sm_scale=None,
                  sinks=None, pos_encoding_mode="NONE", rope_scale=None, rope_theta=None):
    """Decode one query against a contiguous cache; the query sits at position kv_len - 1 (RoPE, ALiBi).

    q [Hq, D]; k, v NHD [kv_len, Hkv, D] or HND [Hkv, kv_len, D]; sinks fp32 [Hq] or None.
    Returns (o [Hq, D] fp32, lse [Hq] fp32, base 2).
    """
    if q.dim() != 2:
        raise ValueError(f"q: expected [num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    k, v = _kv_nhd(k, v, kv_layout)
    opts = _options(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                    pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    o, lse = _attend(q[None], k, v, opts, sinks=_sinks(sinks, q.shape[0]))
    return o[0], lse[0]


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
    sinks=None,
    pos_encoding_mode="NONE",
    rope_scale=None,
    rope_theta=None,
):
    """Decode a batch against a paged cache (FlashInfer's BatchDecode semantics; each query sits at
    position kv_len - 1 of its request for RoPE and ALiBi).

    q [B, Hq, D]; indptr [B + 1], indices [indptr[-1]], last_page_len [B] (any device); sinks fp32
    [Hq] or None (see the module doc).
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
    opts = _options(window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                    pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    k_pages, v_pages = _pages_nhd(paged_kv_cache, kv_layout)
    ks, vs = gather_dense_kv((k_pages, v_pages), indptr.cpu(), indices, last_page_len.cpu())
    # request i is a prefill of the one query row i
    return _attend_batch(q, list(range(batch_size + 1)), ks, vs, [None] * batch_size, opts, torch.float32,
                          v_pages.shape[-1], sinks)


# ---------------------------------------------------------------------------------------
# prefill


def _check_qk(q, k, q_layout: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"q: expected {q_layout}, got shape {tuple(q.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected head_dim_qk {q.shape[-1]} (q's), got {k.shape[-1]}")


def _custom_mask(custom_mask, qo_len: int, kv_len: int):
    if custom_mask is None:
        return None
    checks.tensor(custom_mask, "custom_mask")
    if custom_mask.dtype != torch.bool or tuple(custom_mask.shape) != (qo_len, kv_len):
        raise ValueError(f"custom_mask: expected torch.bool [qo_len, kv_len] = [{qo_len}, {kv_len}], "
                         f"got {custom_mask.dtype} {tuple(custom_mask.shape)}")
    return custom_mask


def _unpack_masks(packed_custom_mask, mask_indptr, qo_lens: list[int], kv_lens: list[int]) -> list:
    """Each request's bool [qo_len, kv_len] mask from the bit-packed buffer, or None per request."""
    if packed_custom_mask is None:
        if mask_indptr is not None:
            raise ValueError("mask_indptr: given without packed_custom_mask")
        return [None] * len(qo_lens)
    checks.tensor(packed_custom_mask, "packed_custom_mask")
    if packed_custom_mask.dtype != torch.uint8 or packed_custom_mask.dim() != 1:
        raise ValueError(f"packed_custom_mask: expected a 1-D torch.uint8 tensor, got "
                         f"{packed_custom_mask.dtype} of shape {tuple(packed_custom_mask.shape)}")
    bits = [qo * kv for qo, kv in zip(qo_lens, kv_lens)]
    nbytes = [-(-n // 8) for n in bits]
    if mask_indptr is None:  # the packing segment_packbits produces: whole bytes per request, back to back
        starts = [sum(nbytes[:i]) for i in range(len(bits) + 1)]
    else:
        starts = checks.indptr(mask_indptr, "mask_indptr", entries=len(bits) + 1)
        sizes = [b - a for a, b in zip(starts, starts[1:])]
        if sizes != nbytes:
            raise ValueError(f"mask_indptr: expected ceil(qo_len * kv_len / 8) bytes per request, {nbytes}, "
                             f"got {sizes}")
    if starts[-1] > packed_custom_mask.numel():
        raise ValueError(f"packed_custom_mask: expected at least {starts[-1]} bytes, got {packed_custom_mask.numel()}")
    return [
        unpackbits(packed_custom_mask[a : a + n], count, bitorder="little").view(qo, kv)
        for a, n, count, qo, kv in zip(starts, nbytes, bits, qo_lens, kv_lens)
    ]


def single_prefill(q, k, v, *, causal: bool = False, kv_layout: str = "NHD", sm_scale=None, window_left: int = -1,
                   logits_soft_cap=None, custom_mask=None, pos_encoding_mode="NONE", rope_scale=None,
                   rope_theta=None, o_dtype=None, sinks=None):
    """Prefill one request against a contiguous cache (FlashInfer's single_prefill_with_kv_cache).

    q [qo_len, Hq, Dqk]; k NHD [kv_len, Hkv, Dqk] or HND [Hkv, kv_len, Dqk], v likewise with Dvo;
    custom_mask bool [qo_len, kv_len] (replaces causal); sinks fp32 [Hq] or None (see the module doc).
    Returns (o [qo_len, Hq, Dvo] in o_dtype, default q's dtype; lse [qo_len, Hq] fp32, base 2).
    """
    opts = _options(causal=causal, window_left=window_left, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                    pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    k, v = _kv_nhd(k, v, kv_layout)
    _check_qk(q, k, "[qo_len, num_qo_heads, head_dim_qk]")
    mask = _custom_mask(custom_mask, q.shape[0], k.shape[0])
    return _attend_batch(q, [0, q.shape[0]], [k], [v], [mask], opts, _o_dtype(o_dtype, q), v.shape[-1], sinks)


def batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, *, causal: bool = False, kv_layout: str = "NHD",
                         sm_scale=None, window_left: int = -1, logits_soft_cap=None, packed_custom_mask=None,
                         mask_indptr=None, pos_encoding_mode="NONE", rope_scale=None, rope_theta=None, o_dtype=None,
                         sinks=None):
    """Prefill a batch against a ragged cache (FlashInfer's BatchPrefillWithRaggedKVCache).

    q [total_q, Hq, Dqk]; k NHD [total_kv, Hkv, Dqk] (HND [Hkv, total_kv, Dqk]), v likewise with
    Dvo; qo_indptr, kv_indptr [B + 1] token index pointers (any device); packed_custom_mask uint8
    and mask_indptr [B + 1] in bytes (default: the segment_packbits layout), see the module doc.
    Returns (o [total_q, Hq, Dvo] in o_dtype, default q's dtype; lse [total_q, Hq] fp32, base 2).
    """
    opts = _options(causal=causal, window_left=window_left, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                    pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    k, v = _kv_nhd(k, v, kv_layout)
    _check_qk(q, k, "[total_q, num_qo_heads, head_dim_qk]")
    qo_bounds = checks.indptr(qo_indptr, "qo_indptr", end=q.shape[0])
    kv_bounds = checks.indptr(kv_indptr, "kv_indptr", entries=len(qo_bounds), end=k.shape[0])
    requests = range(len(qo_bounds) - 1)
    ks = [k[kv_bounds[i] : kv_bounds[i + 1]] for i in requests]
    vs = [v[kv_bounds[i] : kv_bounds[i + 1]] for i in requests]
    qo_lens = [qo_bounds[i + 1] - qo_bounds[i] for i in requests]
    masks = _unpack_masks(packed_custom_mask, mask_indptr, qo_lens, [x.shape[0] for x in ks])
    return _attend_batch(q, qo_bounds, ks, vs, masks, opts, _o_dtype(o_dtype, q), v.shape[-1], sinks)


def batch_prefill_paged(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *,
                        causal: bool = False, kv_layout: str = "NHD", sm_scale=None, window_left: int = -1,
                        logits_soft_cap=None, packed_custom_mask=None, mask_indptr=None, pos_encoding_mode="NONE",
                        rope_scale=None, rope_theta=None, o_dtype=None, sinks=None):
    """Prefill a batch against a paged cache (FlashInfer's BatchPrefillWithPagedKVCache).

    q [total_q, Hq, Dqk]; the cache as in the module doc (K pages with Dqk, V pages with Dvo);
    qo_indptr [B + 1] tokens, paged_kv_indptr [B + 1] pages, paged_kv_indices, and
    paged_kv_last_page_len [B] (any device); the custom mask as in batch_prefill_ragged.
    Returns (o [total_q, Hq, Dvo] in o_dtype, default q's dtype; lse [total_q, Hq] fp32, base 2).
    """
    opts = _options(causal=causal, window_left=window_left, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                    pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    qo_bounds = checks.indptr(qo_indptr, "qo_indptr", end=q.shape[0])
    batch_size = len(qo_bounds) - 1
    page_bounds = checks.indptr(paged_kv_indptr, "paged_kv_indptr", entries=batch_size + 1)
    checks.tensor(paged_kv_indices, "paged_kv_indices")
    if page_bounds[-1] > paged_kv_indices.numel():
        raise ValueError(f"paged_kv_indices: expected at least {page_bounds[-1]} page ids (paged_kv_indptr[-1]), "
                         f"got {paged_kv_indices.numel()}")
    checks.tensor(paged_kv_last_page_len, "paged_kv_last_page_len")
    k_pages, v_pages = _pages_nhd(paged_kv_cache, kv_layout)
    _check_qk(q, k_pages, "[total_q, num_qo_heads, head_dim_qk]")
    last = paged_kv_last_page_len.tolist()
    page_size = k_pages.shape[1]
    if len(last) != batch_size or not all(0 <= n <= page_size for n in last):
        raise ValueError(f"paged_kv_last_page_len: expected {batch_size} entries in [0, {page_size}] (page_size), "
                         f"got {last}")
    ks, vs = gather_dense_kv((k_pages, v_pages), paged_kv_indptr.cpu(), paged_kv_indices,
                             paged_kv_last_page_len.cpu())
    qo_lens = [qo_bounds[i + 1] - qo_bounds[i] for i in range(batch_size)]
    masks = _unpack_masks(packed_custom_mask, mask_indptr, qo_lens, [x.shape[0] for x in ks])
    return _attend_batch(q, qo_bounds, ks, vs, masks, opts, _o_dtype(o_dtype, q), v_pages.shape[-1], sinks)
