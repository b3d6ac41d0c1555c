"""attnforge.reference prefill: against a naive scalar implementation, and metamorphic checks
(qo_len 1 is decode, causal is a custom mask, ragged is paged, GQA is repeated heads, in-kernel
RoPE is RoPE applied beforehand)."""

from __future__ import annotations

import cmath
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnforge
from attnforge import reference

LN2 = math.log(2.0)

# ---------------------------------------------------------------------------------------
# naive oracle: one (row, head, key) at a time in float64, sharing no masking code


def _naive_rope(x: torch.Tensor, pos: int, scale: float, theta: float) -> torch.Tensor:
    """Dims (i, i + D/2) as one complex number, turned by pos * theta^(-2i/D) / scale."""
    half = x.shape[0] // 2
    out = x.clone()
    for i in range(half):
        z = complex(x[i], x[i + half]) * cmath.exp(1j * pos * theta ** (-2 * i / x.shape[0]) / scale)
        out[i], out[i + half] = z.real, z.imag
    return out


def _naive_prefill(q, k, v, *, causal, window_left, cap, sm_scale, mask, pos_encoding, rope_scale, rope_theta):
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[:2]
    group = num_qo_heads // num_kv_heads
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    slopes = reference.alibi_slopes(num_qo_heads).tolist()
    o = torch.zeros(qo_len, num_qo_heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((qo_len, num_qo_heads), -math.inf, dtype=torch.float64)
    for t in range(qo_len):
        q_pos = t + kv_len - qo_len
        for h in range(num_qo_heads):
            qv = q[t, h].double()
            if pos_encoding == "ROPE_LLAMA":
                qv = _naive_rope(qv, q_pos, rope_scale, rope_theta)
            scores, values = [], []
            for j in range(kv_len):
                seen = bool(mask[t, j]) if mask is not None else (not causal or j <= q_pos)
                if not seen or (window_left >= 0 and j < q_pos - window_left):
                    continue
                kv = k[j, h // group].double()
                if pos_encoding == "ROPE_LLAMA":
                    kv = _naive_rope(kv, j, rope_scale, rope_theta)
                s = float(qv @ kv) * scale
                if pos_encoding == "ALIBI":
                    s += slopes[h] * (j - q_pos)
                if cap:
                    s = cap * math.tanh(s / cap)
                scores.append(s)
                values.append(v[j, h // group].double())
            if scores:
                m = max(scores)
                weights = [math.exp(s - m) for s in scores]
                o[t, h] = sum(w * x for w, x in zip(weights, values)) / sum(weights)
                lse[t, h] = (m + math.log(sum(weights))) / LN2
    return o, lse


@st.composite
def single_cases(draw):
    num_kv_heads = draw(st.integers(1, 3))
    head_dim_qk = draw(st.sampled_from([4, 8]))
    return dict(
        qo_len=draw(st.integers(1, 9)),
        kv_len=draw(st.integers(0, 12)),
        num_kv_heads=num_kv_heads,
        num_qo_heads=num_kv_heads * draw(st.integers(1, 3)),
        head_dim_qk=head_dim_qk,
        head_dim_vo=draw(st.sampled_from([head_dim_qk, 6])),
        causal=draw(st.booleans()),
        use_mask=draw(st.booleans()),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 12))),
        cap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        sm_scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        pos_encoding=draw(st.sampled_from(["NONE", "ROPE_LLAMA", "ALIBI"])),
        rope_scale=draw(st.floats(0.25, 4.0)),
        rope_theta=draw(st.sampled_from([10.0, 1e4, 5e5])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _tensors(c):
    gen = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["qo_len"], c["num_qo_heads"], c["head_dim_qk"], generator=gen)
    k = torch.randn(c["kv_len"], c["num_kv_heads"], c["head_dim_qk"], generator=gen)
    v = torch.randn(c["kv_len"], c["num_kv_heads"], c["head_dim_vo"], generator=gen)
    mask = torch.rand(c["qo_len"], c["kv_len"], generator=gen) < 0.6 if c["use_mask"] else None
    return q, k, v, mask


@settings(max_examples=150, deadline=None)
@given(single_cases())
def test_single_prefill_matches_naive(c):
    q, k, v, mask = _tensors(c)
    o, lse = reference.single_prefill(
        q, k, v, causal=c["causal"], window_left=c["window_left"], logits_soft_cap=c["cap"], sm_scale=c["sm_scale"],
        custom_mask=mask, pos_encoding_mode=c["pos_encoding"], rope_scale=c["rope_scale"], rope_theta=c["rope_theta"],
    )
    o_n, lse_n = _naive_prefill(
        q, k, v, causal=c["causal"], window_left=c["window_left"], cap=c["cap"], sm_scale=c["sm_scale"], mask=mask,
        pos_encoding=c["pos_encoding"], rope_scale=c["rope_scale"], rope_theta=c["rope_theta"],
    )
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_n, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_n, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# batches: random ragged lengths, stored both ragged and paged


@st.composite
def batch_cases(draw):
    batch = draw(st.integers(0, 4))
    page_size = draw(st.integers(1, 8))
    num_kv_heads = draw(st.integers(1, 2))
    kv_lens = draw(st.lists(st.integers(0, 3 * page_size + 1), min_size=batch, max_size=batch))
    pages_per = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_per) + draw(st.integers(0, 2))
    return dict(
        qo_lens=draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)),
        kv_lens=kv_lens,
        page_size=page_size,
        pages_per=pages_per,
        num_pages=num_pages,
        page_ids=draw(st.permutations(range(num_pages)))[: sum(pages_per)],  # non-contiguous page table
        # a request with no pages may carry any last_page_len: kv_len is 0 regardless
        empty_last=draw(st.integers(1, page_size)),
        num_kv_heads=num_kv_heads,
        num_qo_heads=num_kv_heads * draw(st.integers(1, 3)),
        head_dims=draw(st.sampled_from([(8, 8), (8, 4)])),
        layout=draw(st.sampled_from(["NHD", "HND"])),
        single_tensor=draw(st.booleans()),
        causal=draw(st.booleans()),
        use_mask=draw(st.booleans()),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 8))),
        cap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        pos_encoding=draw(st.sampled_from(["NONE", "ROPE_LLAMA", "ALIBI"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _indptr(lengths) -> torch.Tensor:
    return torch.tensor([sum(lengths[:i]) for i in range(len(lengths) + 1)], dtype=torch.int32)


def _batch(c):
    """q, the ragged k/v, the paged cache (in c's layout) with its page table, and the packed masks."""
    gen = torch.Generator().manual_seed(c["seed"])
    dqk, dvo = c["head_dims"]
    total_q, total_kv = sum(c["qo_lens"]), sum(c["kv_lens"])
    q = torch.randn(total_q, c["num_qo_heads"], dqk, generator=gen)
    k = torch.randn(total_kv, c["num_kv_heads"], dqk, generator=gen)
    v = torch.randn(total_kv, c["num_kv_heads"], dvo, generator=gen)
    page_shape = (c["num_pages"], c["page_size"], c["num_kv_heads"])
    k_pages, v_pages = torch.randn(*page_shape, dqk, generator=gen), torch.randn(*page_shape, dvo, generator=gen)
    kv_indptr, page_indptr = _indptr(c["kv_lens"]), _indptr(c["pages_per"])
    for r, kv_len in enumerate(c["kv_lens"]):
        for j in range(kv_len):
            page = c["page_ids"][page_indptr[r] + j // c["page_size"]]
            k_pages[page, j % c["page_size"]] = k[kv_indptr[r] + j]
            v_pages[page, j % c["page_size"]] = v[kv_indptr[r] + j]
    if c["layout"] == "HND":
        k_pages, v_pages = k_pages.transpose(1, 2), v_pages.transpose(1, 2)
    cache = torch.stack([k_pages, v_pages], 1) if c["single_tensor"] and dqk == dvo else (k_pages, v_pages)
    last = [n - (p - 1) * c["page_size"] if p else c["empty_last"] for n, p in zip(c["kv_lens"], c["pages_per"])]
    masks = [torch.rand(qo, kv, generator=gen) < 0.5 for qo, kv in zip(c["qo_lens"], c["kv_lens"])]
    packed = None
    if c["use_mask"]:
        flat = torch.cat([m.reshape(-1) for m in masks]) if masks else torch.zeros(0, dtype=torch.bool)
        bits = [qo * kv for qo, kv in zip(c["qo_lens"], c["kv_lens"])]
        packed, _ = attnforge.segment_packbits(flat, _indptr(bits), bitorder="little")
    return dict(
        q=q, k=k, v=v, cache=cache, qo_indptr=_indptr(c["qo_lens"]), kv_indptr=kv_indptr, page_indptr=page_indptr,
        page_ids=torch.tensor(c["page_ids"], dtype=torch.int32), last=torch.tensor(last, dtype=torch.int32),
        masks=masks, packed=packed,
    )


def _options(c):
    return dict(causal=c["causal"], window_left=c["window_left"], logits_soft_cap=c["cap"],
                pos_encoding_mode=c["pos_encoding"])


@settings(max_examples=100, deadline=None)
@given(batch_cases())
def test_ragged_equals_paged_equals_each_request_alone(c):
    b = _batch(c)
    o_r, lse_r = reference.batch_prefill_ragged(b["q"], b["k"], b["v"], b["qo_indptr"], b["kv_indptr"],
                                                packed_custom_mask=b["packed"], **_options(c))
    o_p, lse_p = reference.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["page_indptr"], b["page_ids"],
                                               b["last"], kv_layout=c["layout"], packed_custom_mask=b["packed"],
                                               **_options(c))
    assert o_r.shape == (len(b["q"]), c["num_qo_heads"], c["head_dims"][1])
    torch.testing.assert_close(o_r, o_p, atol=0, rtol=0)
    torch.testing.assert_close(lse_r, lse_p, atol=0, rtol=0)
    qo, kv = b["qo_indptr"].tolist(), b["kv_indptr"].tolist()
    for r in range(len(c["qo_lens"])):
        o_s, lse_s = reference.single_prefill(b["q"][qo[r] : qo[r + 1]], b["k"][kv[r] : kv[r + 1]],
                                              b["v"][kv[r] : kv[r + 1]],
                                              custom_mask=b["masks"][r] if c["use_mask"] else None, **_options(c))
        torch.testing.assert_close(o_r[qo[r] : qo[r + 1]], o_s, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse_r[qo[r] : qo[r + 1]], lse_s, atol=1e-6, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(batch_cases())
def test_one_query_token_is_decode(c):
    b = _batch(c)
    batch = len(c["qo_lens"])
    q = torch.randn(batch, c["num_qo_heads"], c["head_dims"][0])
    table = (b["page_indptr"], b["page_ids"], b["last"])
    opts = dict(kv_layout=c["layout"], window_left=c["window_left"], logits_soft_cap=c["cap"], sm_scale=0.4)
    one_token_each = torch.arange(batch + 1, dtype=torch.int32)
    o_p, lse_p = reference.batch_prefill_paged(q, b["cache"], one_token_each, *table, o_dtype=torch.float32, **opts)
    o_d, lse_d = reference.batch_decode_paged(q, b["cache"], *table, **opts)
    torch.testing.assert_close(o_p, o_d, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_p, lse_d, atol=1e-6, rtol=1e-6)


def _causal_mask(qo_len: int, kv_len: int) -> torch.Tensor:
    """Bottom-right aligned: row t sees keys 0 .. t + kv_len - qo_len."""
    return torch.ones(qo_len, kv_len, dtype=torch.bool).tril(kv_len - qo_len)


@settings(max_examples=60, deadline=None)
@given(batch_cases())
def test_causal_is_the_causal_custom_mask(c):
    c = dict(c, causal=True, use_mask=False)
    b = _batch(c)
    flat = [_causal_mask(qo, kv).reshape(-1) for qo, kv in zip(c["qo_lens"], c["kv_lens"])]
    bits = [qo * kv for qo, kv in zip(c["qo_lens"], c["kv_lens"])]
    packed, mask_indptr = attnforge.segment_packbits(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.bool),
                                                     _indptr(bits), bitorder="little")
    args = (b["q"], b["k"], b["v"], b["qo_indptr"], b["kv_indptr"])
    o_c, lse_c = reference.batch_prefill_ragged(*args, **_options(c))
    # the mask replaces causal, so passing causal=True alongside it changes nothing
    o_m, lse_m = reference.batch_prefill_ragged(*args, packed_custom_mask=packed, mask_indptr=mask_indptr,
                                                **dict(_options(c), causal=False))
    torch.testing.assert_close(o_c, o_m, atol=0, rtol=0)
    torch.testing.assert_close(lse_c, lse_m, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------
# single-request properties


@settings(max_examples=60, deadline=None)
@given(single_cases())
def test_gqa_equals_repeated_kv_heads(c):
    q, k, v, mask = _tensors(c)
    group = c["num_qo_heads"] // c["num_kv_heads"]
    opts = dict(causal=c["causal"], window_left=c["window_left"], logits_soft_cap=c["cap"], custom_mask=mask,
                pos_encoding_mode=c["pos_encoding"])
    o, lse = reference.single_prefill(q, k, v, **opts)
    o_mha, lse_mha = reference.single_prefill(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), **opts)
    torch.testing.assert_close(o, o_mha, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_mha, atol=1e-6, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(single_cases())
def test_rope_in_kernel_equals_rope_applied_beforehand(c):
    q, k, v, _ = _tensors(c)
    qo_len, kv_len = c["qo_len"], c["kv_len"]
    rope = dict(rope_scale=c["rope_scale"], rope_theta=c["rope_theta"])
    opts = dict(causal=c["causal"], window_left=c["window_left"], logits_soft_cap=c["cap"])
    q_rot = torch.stack([torch.stack([_naive_rope(q[t, h].double(), t + kv_len - qo_len, c["rope_scale"],
                                                  c["rope_theta"]) for h in range(q.shape[1])]) for t in range(qo_len)])
    k_rot = torch.stack([torch.stack([_naive_rope(k[j, h].double(), j, c["rope_scale"], c["rope_theta"])
                                      for h in range(k.shape[1])]) for j in range(kv_len)]) if kv_len else k
    o, lse = reference.single_prefill(q, k, v, pos_encoding_mode="ROPE_LLAMA", **rope, **opts)
    o_pre, lse_pre = reference.single_prefill(q_rot.float(), k_rot.float(), v, **opts)
    torch.testing.assert_close(o, o_pre, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_pre, atol=1e-5, rtol=1e-5)


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v = torch.randn(7, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    o, lse = reference.single_prefill(q, k, v, causal=True)  # rows 0..3 sit before key 0
    assert torch.equal(o[:4], torch.zeros(4, 4, 8)) and torch.equal(lse[:4], torch.full((4, 4), -math.inf))
    assert torch.isfinite(o[4:]).all() and torch.isfinite(lse[4:]).all()
    o, lse = reference.single_prefill(q, k[:0], v[:0])  # no keys at all
    assert torch.equal(o, torch.zeros(7, 4, 8)) and torch.equal(lse, torch.full((7, 4), -math.inf))


def test_lse_by_hand():
    """Two keys, causal, qo_len == kv_len: row 0 sees key 0 only, row 1 sees both."""
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])  # [2 tokens, 1 head, 2]
    k = torch.tensor([[[1.0, 1.0]], [[3.0, -1.0]]])
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    o, lse = reference.single_prefill(q, k, v, causal=True, sm_scale=1.0)
    s1 = torch.tensor([2.0, -2.0])  # q1 . k0, q1 . k1
    torch.testing.assert_close(lse[:, 0], torch.stack([torch.tensor(1.0), torch.logsumexp(s1, 0)]) / LN2)
    torch.testing.assert_close(o[1, 0], torch.softmax(s1, 0))
    torch.testing.assert_close(o[0, 0], v[0, 0])


def test_alibi_slopes():
    torch.testing.assert_close(reference.alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence
    sixteen = reference.alibi_slopes(16)
    torch.testing.assert_close(reference.alibi_slopes(12), torch.cat([reference.alibi_slopes(8), sixteen[0::2][:4]]))
    assert reference.alibi_slopes(1).tolist() == [2.0 ** -8]


def test_alibi_shifts_lse_by_the_bias():
    """With one key per row the bias is all the score there is: lse = slope * (j - q_pos) / ln 2."""
    q, k, v = torch.zeros(3, 2, 4), torch.zeros(5, 2, 4), torch.randn(5, 2, 4)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 4] = mask[1, 0] = mask[2, 3] = True
    _, lse = reference.single_prefill(q, k, v, custom_mask=mask, pos_encoding_mode="ALIBI")
    q_pos = torch.tensor([2.0, 3.0, 4.0])
    j = torch.tensor([4.0, 0.0, 3.0])
    torch.testing.assert_close(lse, (reference.alibi_slopes(2)[None, :] * (j - q_pos)[:, None]) / LN2)


def test_output_dtype_defaults_to_q_and_lse_is_fp32():
    q, k, v = torch.randn(3, 2, 8, dtype=torch.bfloat16), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    o, lse = reference.single_prefill(q, k, v)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o, _ = reference.single_prefill(q, k, v, o_dtype=torch.float16)
    assert o.dtype == torch.float16


def test_hnd_equals_nhd():
    q, k, v = torch.randn(5, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    o1, l1 = reference.single_prefill(q, k, v, causal=True)
    o2, l2 = reference.single_prefill(q, k.transpose(0, 1), v.transpose(0, 1), causal=True, kv_layout="HND")
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)


# ---------------------------------------------------------------------------------------
# bad arguments

_Q, _K, _V = torch.randn(3, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
_QO, _KV = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
_PAGES = (torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
_PAGED = (_QO, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: reference.single_prefill(_Q, _K, _V, window_left=-2), "window_left"),
        (lambda: reference.single_prefill(_Q, _K, _V, logits_soft_cap=-1.0), "logits_soft_cap"),
        (lambda: reference.single_prefill(_Q, _K, _V, sm_scale=0.0), "sm_scale"),
        (lambda: reference.single_prefill(_Q, _K, _V, causal=1), "causal"),
        (lambda: reference.single_prefill(_Q, _K, _V, pos_encoding_mode="ROPE"), "pos_encoding_mode"),
        (lambda: reference.single_prefill(_Q, _K, _V, pos_encoding_mode="ROPE_LLAMA", rope_theta=-1.0), "rope_theta"),
        (lambda: reference.single_prefill(_Q, _K, _V, kv_layout="NDH"), "kv_layout"),
        (lambda: reference.single_prefill(_Q, _K, _V, o_dtype=torch.int32), "o_dtype"),
        (lambda: reference.single_prefill(_Q, _K, _V, custom_mask=torch.ones(3, 3, dtype=torch.bool)), "custom_mask"),
        (lambda: reference.single_prefill(_Q[0], _K, _V), "q"),
        (lambda: reference.single_prefill(_Q[:, :1], _K.expand(4, 2, 8), _V.expand(4, 2, 8)), "q"),
        (lambda: reference.single_prefill(_Q, _K[..., :4], _V), "k"),
        (lambda: reference.single_prefill(_Q, _K, _V[:2]), "v"),
        (lambda: reference.single_prefill(_Q[..., :7], _K[..., :7], _V, pos_encoding_mode="ROPE_LLAMA"), "q"),
        (lambda: reference.batch_prefill_ragged(_Q, _K, _V, _QO[:1] + 1, _KV), "qo_indptr"),
        (lambda: reference.batch_prefill_ragged(_Q, _K, _V, _QO, torch.tensor([0, 3])), "kv_indptr"),
        (lambda: reference.batch_prefill_ragged(_Q, _K, _V, _QO, _KV, mask_indptr=torch.tensor([0, 2])), "mask_indptr"),
        (lambda: reference.batch_prefill_ragged(_Q, _K, _V, _QO, _KV, packed_custom_mask=torch.zeros(1, dtype=torch.uint8)),
         "packed_custom_mask"),
        (lambda: reference.batch_prefill_ragged(_Q, _K, _V, _QO, _KV, packed_custom_mask=torch.zeros(4, dtype=torch.uint8),
                                                mask_indptr=torch.tensor([0, 1])), "mask_indptr"),
        (lambda: reference.batch_prefill_paged(_Q, _PAGES, *_PAGED, torch.tensor([3], dtype=torch.int32)),
         "paged_kv_last_page_len"),
        (lambda: reference.batch_prefill_paged(_Q, _PAGES, _QO, torch.tensor([0, 3], dtype=torch.int32), _PAGED[2],
                                               torch.tensor([1], dtype=torch.int32)), "paged_kv_indices"),
        (lambda: reference.batch_prefill_paged(_Q, _PAGES, *_PAGED[:2], torch.tensor([1, 5], dtype=torch.int32),
                                               torch.tensor([1], dtype=torch.int32)), "indices"),
    ],
)
def test_bad_arguments_name_themselves(call, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        call()
