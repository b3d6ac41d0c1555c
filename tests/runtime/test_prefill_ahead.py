"""fa3 prefill work done ahead of the kernel (CPU): which paged plans gather their pages into ragged
K and V, where each request's rows land, and which fp8 plans have V transposed ahead, with the
block prefix the kernels search (mirrored here as `request_of_block`)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge.prefill_ahead import (
    VT_BLOCK_KEYS,
    gathered_kv_bytes,
    gathered_rows,
    gathers_pages,
    reads_per_key,
    transposed_v_blocks,
)

requests = st.lists(st.tuples(st.integers(0, 700), st.integers(0, 5000)), min_size=1, max_size=12)


def request_of_block(first: list[int], block: int) -> int:
    """transpose_v_kernel's search: the last request whose first block is at or before `block`."""
    lo, hi = 0, len(first) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if first[mid] <= block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@settings(max_examples=200, deadline=None)
@given(requests, st.sampled_from([1, 4, 8, 16]))
def test_blocks_cover_the_keys_of_every_request_a_query_reads(lens, group):
    qo = torch.tensor([q for q, _ in lens], dtype=torch.int32)
    kv = torch.tensor([k for _, k in lens], dtype=torch.int32)
    first = transposed_v_blocks(qo, kv, group, 128)
    tiles = [-(-q * group // 128) for q, _ in lens]
    readers = [t for t, (_, k) in zip(tiles, lens) if t > 0 and k > 0]
    if not readers or sum(readers) < 2 * len(readers):
        assert first is None  # V read about once: the kernel transposes
        return
    assert first.dtype == torch.int32 and first.numel() == len(lens) + 1 and first[0] == 0
    first = first.tolist()
    for r, (q, k) in enumerate(lens):
        expected = -(-k // VT_BLOCK_KEYS) if q > 0 and k > 0 else 0
        assert first[r + 1] - first[r] == expected
        for block in range(first[r], first[r + 1]):
            assert request_of_block(first, block) == r


def test_one_query_tile_per_request_keeps_the_kernel_transposes():
    """Decode-like plans (one token per request) and short chunks read V once per request."""
    kv = torch.tensor([4096, 300, 7], dtype=torch.int32)
    assert transposed_v_blocks(torch.tensor([1, 1, 1]), kv, 8, 128) is None
    assert transposed_v_blocks(torch.tensor([32, 16, 1]), kv, 4, 128) is None
    assert transposed_v_blocks(torch.tensor([128, 64, 16]), kv, 4, 128).tolist() == [0, 32, 35, 36]


def rows_reading_each_key(qo: int, kv: int, causal: bool, window_left: int) -> int:
    """(query, key) pairs of one request, counted row by row: row i sees keys up to i + kv - qo
    when causal (bottom-right aligned), at most window_left + 1 of them with a window."""
    pairs = 0
    for i in range(qo):
        seen = max(0, min(kv, i + kv - qo + 1)) if causal else kv
        pairs += min(seen, window_left + 1) if window_left >= 0 else seen
    return pairs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 400)), min_size=1, max_size=6),
       st.sampled_from([1, 4, 8]), st.booleans())
def test_reads_per_key_counts_what_each_row_sees(lens, group, causal):
    qo = torch.tensor([q for q, _ in lens], dtype=torch.int32)
    kv = torch.tensor([k for _, k in lens], dtype=torch.int32)
    keys = sum(k for _, k in lens)
    full = sum(rows_reading_each_key(q, k, causal, -1) for q, k in lens)
    assert reads_per_key(qo, kv, group, causal, -1) == (group * full / keys if keys else 0.0)
    # a window caps each row; the estimate caps each request, so it can only count more, never less
    windowed = sum(rows_reading_each_key(q, k, causal, 16) for q, k in lens)
    estimate = reads_per_key(qo, kv, group, causal, 16)
    assert (group * windowed / keys if keys else 0.0) <= estimate <= reads_per_key(qo, kv, group, causal, -1)


def test_long_prefills_gather_their_pages_and_short_or_decode_plans_do_not():
    """The benchmark's shapes at GQA 4: 4 x 4096 and 1 x 16384 gather, causal too; 16 x 1024 (4096
    rows read each key) and decode do not."""
    def gathers(batch: int, qo_len: int, kv_len: int, causal: bool) -> bool:
        qo = torch.full((batch,), qo_len, dtype=torch.int32)
        return gathers_pages(qo, torch.full((batch,), kv_len, dtype=torch.int32), 4, causal, -1)

    for causal in (False, True):
        assert gathers(4, 4096, 4096, causal) and gathers(1, 16384, 16384, causal)
        assert not gathers(16, 1024, 1024, causal)
        assert not gathers(64, 1, 4096, causal)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=10), st.integers(0, 5), st.sampled_from([1, 5, 16]))
def test_gathered_rows_put_each_request_at_its_first_page(pages, first_page, page_size):
    """Pages are copied in page-table order from page_indptr[0]: request r's rows start at its first
    page's position times page_size, and hold its pages whole."""
    indptr = torch.tensor([first_page, *(first_page + torch.tensor(pages).cumsum(0)).tolist()], dtype=torch.int32)
    rows = gathered_rows(indptr, page_size)
    assert rows.dtype == torch.int32 and rows[0] == 0
    assert ((rows[1:] - rows[:-1]) == torch.tensor(pages) * page_size).all()


def test_gathered_bytes_are_k_and_v_rows_rounded_to_1024():
    assert gathered_kv_bytes(16, 8, 128 + 128, 2) == 16 * 8 * 256 * 2
    assert gathered_kv_bytes(5, 1, 192 + 128, 1) == 2048
    assert gathered_kv_bytes(0, 8, 256, 2) == 0
