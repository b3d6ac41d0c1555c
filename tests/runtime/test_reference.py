"""attnforge.reference against a naive token-by-token implementation (CPU, float64).

The naive version walks the page table one token at a time and computes each head's
softmax with scalar loops, so it shares no indexing or masking code with the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge import reference

# ---------------------------------------------------------------------------------------
# naive oracle


def _naive_key(cache, page: int, slot: int, head: int, layout: str) -> torch.Tensor:
    return cache[page, slot, head] if layout == "NHD" else cache[page, head, slot]


def _naive_decode(q, k_cache, v_cache, indptr, indices, last_page_len, layout, window_left, cap, sm_scale):
    """Returns (o [B, Hq, D] float64, lse [B, Hq] float64 base 2)."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2] if layout == "NHD" else k_cache.shape[1]
    page_size = k_cache.shape[1] if layout == "NHD" else k_cache.shape[2]
    group = num_qo_heads // num_kv_heads
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    o = torch.zeros(batch, num_qo_heads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, num_qo_heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        pages = indices[indptr[b] : indptr[b + 1]].tolist()
        kv_len = 0 if not pages else (len(pages) - 1) * page_size + int(last_page_len[b])
        first = 0 if window_left < 0 else max(0, kv_len - 1 - window_left)
        for h in range(num_qo_heads):
            scores, values = [], []
            for t in range(first, kv_len):
                page, slot = pages[t // page_size], t % page_size
                key = _naive_key(k_cache, page, slot, h // group, layout).double()
                s = float(q[b, h].double() @ key) * scale
                if cap:
                    s = cap * math.tanh(s / cap)
                scores.append(s)
                values.append(_naive_key(v_cache, page, slot, h // group, layout).double())
            if not scores:
                continue
            m = max(scores)
            weights = [math.exp(s - m) for s in scores]
            total = sum(weights)
            o[b, h] = sum(w * val for w, val in zip(weights, values)) / total
            lse[b, h] = (m + math.log(total)) / math.log(2)
    return o, lse


# ---------------------------------------------------------------------------------------
# drawn cases


@st.composite
def paged_cases(draw):
    page_size = draw(st.integers(1, 64))
    batch = draw(st.integers(1, 4))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    # ragged lengths in tokens, including empty requests and partial last pages
    lens = draw(st.lists(st.integers(0, 3 * page_size + 2), min_size=batch, max_size=batch))
    pages_per = [math.ceil(n / page_size) for n in lens]
    spare = draw(st.integers(0, 3))
    num_pages = sum(pages_per) + spare
    perm = draw(st.permutations(range(num_pages)))  # non-contiguous page table
    indices = torch.tensor(perm[: sum(pages_per)], dtype=torch.int32)
    indptr = torch.tensor([0] + [sum(pages_per[: i + 1]) for i in range(batch)], dtype=torch.int32)
    last = [n - (p - 1) * page_size if p else draw(st.integers(1, page_size)) for n, p in zip(lens, pages_per)]
    return dict(
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        num_qo_heads=num_kv_heads * group,
        head_dim=head_dim,
        num_pages=num_pages,
        indptr=indptr,
        indices=indices,
        last_page_len=torch.tensor(last, dtype=torch.int32),
        layout=draw(st.sampled_from(["NHD", "HND"])),
        single_tensor=draw(st.booleans()),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 3 * page_size + 2))),
        cap=draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
        sm_scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _make_cache(c):
    gen = torch.Generator().manual_seed(c["seed"])
    heads_tokens = (c["page_size"], c["num_kv_heads"])
    if c["layout"] == "HND":
        heads_tokens = heads_tokens[::-1]
    shape = (c["num_pages"], 2, *heads_tokens, c["head_dim"])
    kv = torch.randn(shape, generator=gen)
    q = torch.randn(len(c["last_page_len"]), c["num_qo_heads"], c["head_dim"], generator=gen)
    return q, kv


@settings(max_examples=150, deadline=None)
@given(paged_cases())
def test_batch_decode_matches_naive(c):
    q, kv = _make_cache(c)
    cache = kv if c["single_tensor"] else (kv[:, 0], kv[:, 1])
    o, lse = reference.batch_decode_paged(
        q, cache, c["indptr"], c["indices"], c["last_page_len"],
        kv_layout=c["layout"], window_left=c["window_left"], logits_soft_cap=c["cap"], sm_scale=c["sm_scale"],
    )
    o_n, lse_n = _naive_decode(
        q, kv[:, 0], kv[:, 1], c["indptr"], c["indices"], c["last_page_len"],
        c["layout"], c["window_left"], c["cap"], c["sm_scale"],
    )
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_n, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_n, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# conventions stated in the docstring


def test_empty_request_gives_zero_and_minus_inf():
    k = torch.randn(3, 2, 4, 8)  # 3 pages of 2 tokens, 4 kv heads
    q = torch.randn(2, 8, 8)
    indptr = torch.tensor([0, 0, 2], dtype=torch.int32)
    o, lse = reference.batch_decode_paged(q, (k, k), indptr, torch.tensor([2, 0], dtype=torch.int32),
                                          torch.tensor([1, 1], dtype=torch.int32))
    assert torch.equal(o[0], torch.zeros(8, 8))
    assert torch.equal(lse[0], torch.full((8,), -math.inf))
    assert torch.isfinite(o[1]).all() and torch.isfinite(lse[1]).all()


def test_lse_is_base_two():
    q = torch.randn(2, 16)
    k, v = torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    _, lse = reference.single_decode(q, k, v, sm_scale=0.3)
    s = (q @ k[:, 0].T) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(s, -1) / math.log(2))


def test_window_zero_sees_only_the_last_key():
    q = torch.randn(4, 8)
    k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    o, _ = reference.single_decode(q, k, v, window_left=0)
    expected = v[-1].repeat_interleave(2, dim=0)
    torch.testing.assert_close(o, expected)


def test_single_decode_hnd_equals_nhd():
    q = torch.randn(6, 8)
    k, v = torch.randn(9, 3, 8), torch.randn(9, 3, 8)
    o1, l1 = reference.single_decode(q, k, v, logits_soft_cap=5.0)
    o2, l2 = reference.single_decode(q, k.transpose(0, 1), v.transpose(0, 1), kv_layout="HND", logits_soft_cap=5.0)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)


def test_gather_dense_kv_reassembles_pages():
    dense = torch.arange(2 * 7 * 1 * 2, dtype=torch.float32).reshape(2, 7, 1, 2)  # 2 requests, 7 tokens
    page_size = 3
    pages = dense.new_zeros(8, page_size, 1, 2)
    layout = {0: [5, 1, 6], 1: [0, 7, 2]}  # request -> page ids (non-contiguous)
    for r, ids in layout.items():
        for j, p in enumerate(ids):
            chunk = dense[r, j * page_size : (j + 1) * page_size]
            pages[p, : len(chunk)] = chunk
    indptr = torch.tensor([0, 3, 6], dtype=torch.int32)
    indices = torch.tensor(layout[0] + layout[1], dtype=torch.int32)
    ks, vs = reference.gather_dense_kv((pages, pages), indptr, indices, torch.tensor([1, 1], dtype=torch.int32))
    assert torch.equal(ks[0], dense[0]) and torch.equal(vs[1], dense[1])


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="kv_layout"):
        reference.single_decode(torch.randn(2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4), kv_layout="NDH")


# ---------------------------------------------------------------------------------------
# position encodings: decode is prefill of one query token per request, at position kv_len - 1


@pytest.mark.parametrize("mode, knobs", [("ROPE_LLAMA", {}), ("ROPE_LLAMA", dict(rope_scale=2.5, rope_theta=5e5)),
                                         ("ALIBI", {})])
def test_decode_pos_encoding_equals_one_token_prefill(mode, knobs):
    gen = torch.Generator().manual_seed(5)
    page_size, kv_lens, heads, dim = 5, [7, 1, 13], (8, 2), 16
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.randperm(sum(pages) + 1, generator=gen)[: sum(pages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    cache = tuple(torch.randn(sum(pages) + 1, page_size, heads[1], dim, generator=gen) for _ in range(2))
    q = torch.randn(len(kv_lens), heads[0], dim, generator=gen)
    o, lse = reference.batch_decode_paged(q, cache, indptr, indices, last, pos_encoding_mode=mode, **knobs)
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    o_pre, lse_pre = reference.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, causal=True,
                                                   pos_encoding_mode=mode, **knobs)
    torch.testing.assert_close(o, o_pre)
    torch.testing.assert_close(lse, lse_pre)
    o_none, _ = reference.batch_decode_paged(q, cache, indptr, indices, last)
    assert not torch.allclose(o[0], o_none[0], atol=1e-3), "the position encoding must change the output"
    # single_decode agrees: request 2's keys, contiguous
    k, v = (x[indices[indptr[2]:indptr[3]].long()].reshape(-1, heads[1], dim)[: kv_lens[2]] for x in cache)
    o_single, lse_single = reference.single_decode(q[2], k, v, pos_encoding_mode=mode, **knobs)
    torch.testing.assert_close(o_single, o[2])
    torch.testing.assert_close(lse_single, lse[2])
