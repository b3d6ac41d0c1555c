"""fa3 fp8 prefill: which plans have V transposed ahead, and the block prefix the kernels search
(CPU). The kernel's block -> request search is mirrored here as `request_of_block`."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge.prefill import VT_BLOCK_KEYS, transposed_v_blocks

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
