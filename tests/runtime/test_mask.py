"""attnforge.packbits / segment_packbits / mask.unpackbits: numpy's bit layout, and round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnforge
from attnforge import mask

bitorders = st.sampled_from(["big", "little"])
bit_lists = st.lists(st.booleans(), max_size=70)


@settings(max_examples=100, deadline=None)
@given(bit_lists, bitorders)
def test_packbits_matches_numpy(bits, bitorder):
    np = pytest.importorskip("numpy")
    x = torch.tensor(bits, dtype=torch.bool)
    expected = np.packbits(np.array(bits, dtype=bool), bitorder=bitorder)
    assert attnforge.packbits(x, bitorder).tolist() == expected.tolist()


@settings(max_examples=100, deadline=None)
@given(bit_lists, bitorders)
def test_unpackbits_inverts_packbits(bits, bitorder):
    x = torch.tensor(bits, dtype=torch.bool)
    packed = attnforge.packbits(x, bitorder)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(bits) + 7) // 8
    assert torch.equal(mask.unpackbits(packed, len(bits), bitorder), x)


@settings(max_examples=100, deadline=None)
@given(st.lists(bit_lists, max_size=5), bitorders)
def test_segment_packbits_packs_each_segment_on_whole_bytes(segments, bitorder):
    x = torch.tensor([b for seg in segments for b in seg], dtype=torch.bool)
    lengths = [len(seg) for seg in segments]
    indptr = torch.tensor([sum(lengths[:i]) for i in range(len(segments) + 1)], dtype=torch.int64)
    packed, new_indptr = attnforge.segment_packbits(x, indptr, bitorder)
    assert new_indptr.dtype == torch.int32
    assert (new_indptr[1:] - new_indptr[:-1]).tolist() == [(n + 7) // 8 for n in lengths]
    assert packed.numel() == new_indptr[-1]
    for i, seg in enumerate(segments):
        own = packed[new_indptr[i] : new_indptr[i + 1]]
        assert torch.equal(own, attnforge.packbits(torch.tensor(seg, dtype=torch.bool), bitorder))
        assert mask.unpackbits(own, len(seg), bitorder).tolist() == seg


def test_documented_example():
    """FlashInfer's docstring example for segment_packbits (big-endian)."""
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    packed, new_indptr = attnforge.segment_packbits(x, torch.tensor([0, 4, 7, 11]), bitorder="big")
    assert packed.tolist() == [0b10110000, 0b00100000, 0b11010000]
    assert new_indptr.tolist() == [0, 1, 2, 3]
    assert attnforge.packbits(x[:8]).tolist() == [0b10110011]  # the default order is big, as in FlashInfer


def test_little_endian_puts_the_first_element_in_bit_zero():
    x = torch.zeros(16, dtype=torch.bool)
    x[0] = x[9] = True
    assert attnforge.packbits(x, bitorder="little").tolist() == [1, 2]


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: attnforge.packbits(torch.ones(3, dtype=torch.bool), bitorder="middle"), "bitorder"),
        (lambda: attnforge.packbits(torch.ones(3)), "x"),
        (lambda: attnforge.segment_packbits(torch.ones(2, 3, dtype=torch.bool), torch.tensor([0, 6])), "x"),
        (lambda: attnforge.segment_packbits(torch.ones(4, dtype=torch.bool), torch.tensor([0, 3])), "indptr"),
        (lambda: attnforge.segment_packbits(torch.ones(4, dtype=torch.bool), torch.tensor([0, 3, 2, 4])), "indptr"),
        (lambda: mask.unpackbits(torch.zeros(1, dtype=torch.uint8), 9), "count"),
        (lambda: mask.unpackbits(torch.zeros(1, dtype=torch.int32), 1), "packed"),
    ],
)
def test_bad_arguments_name_themselves(call, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        call()
