"""attnforge.merge: algebra of attention states, exactness against the reference, -inf
handling and argument errors (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge import reference
from attnforge.merge import merge_state, merge_states

INF = math.inf


def _states(seed: int, n: int, seq=3, heads=4, dim=8, empty_prob=0.2):
    """n random states; roughly empty_prob of the (row, head) entries are empty (-inf)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        v = torch.randn(seq, heads, dim, generator=gen)
        s = torch.randn(seq, heads, generator=gen) * 4
        s[torch.rand(seq, heads, generator=gen) < empty_prob] = -INF
        out.append((v, s))
    return out


def _close(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_merge_state_is_commutative_and_associative(seed):
    a, b, c = _states(seed, 3)
    _close(merge_state(*a, *b), merge_state(*b, *a))
    _close(merge_state(*merge_state(*a, *b), *c), merge_state(*a, *merge_state(*b, *c)))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6))
def test_merge_states_equals_folding_merge_state(seed, n):
    states = _states(seed, n)
    v0, s0 = states[0]
    acc = (torch.zeros_like(v0), torch.full_like(s0, -INF))  # start from the empty state
    for st_ in states:
        acc = merge_state(*acc, *st_)
    v = torch.stack([v for v, _ in states], dim=1)
    s = torch.stack([s for _, s in states], dim=1)
    _close(merge_states(v, s), acc)


@settings(max_examples=60, deadline=None)
@given(
    kv_len=st.integers(2, 200),
    cut=st.floats(0.0, 1.0),
    group=st.integers(1, 4),
    cap=st.one_of(st.none(), st.floats(1.0, 30.0)),
    seed=st.integers(0, 2**31 - 1),
)
def test_merging_the_halves_equals_attention_over_the_union(kv_len, cut, group, cap, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2 * group, 16, generator=gen)
    k, v = torch.randn(kv_len, 2, 16, generator=gen), torch.randn(kv_len, 2, 16, generator=gen)
    m = round(cut * kv_len)  # either half may be empty
    halves = [reference.single_decode(q, k[a:b], v[a:b], logits_soft_cap=cap) for a, b in ((0, m), (m, kv_len))]
    (v_a, s_a), (v_b, s_b) = halves
    o, s = merge_state(v_a[None], s_a[None], v_b[None], s_b[None])
    o_all, s_all = reference.single_decode(q, k, v, logits_soft_cap=cap)
    torch.testing.assert_close(o[0], o_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s[0], s_all, atol=1e-5, rtol=1e-5)


def test_empty_state_is_the_identity_even_with_garbage_v():
    (v, s), = _states(0, 1, empty_prob=0.0)
    garbage = torch.full_like(v, math.nan)
    o, lse = merge_state(v, s, garbage, torch.full_like(s, -INF))
    assert torch.equal(o, v) and torch.equal(lse, s)


def test_all_empty_gives_zero_and_minus_inf():
    v = torch.full((2, 3, 4, 8), math.nan)
    s = torch.full((2, 3, 4), -INF)
    o, lse = merge_states(v, s)
    assert torch.equal(o, torch.zeros(2, 4, 8))
    assert torch.equal(lse, torch.full((2, 4), -INF))


def test_huge_lse_gap_does_not_overflow():
    v_a, v_b = torch.ones(1, 1, 4), -torch.ones(1, 1, 4)
    o, lse = merge_state(v_a, torch.tensor([[1000.0]]), v_b, torch.tensor([[-1000.0]]))
    assert torch.equal(o, v_a) and lse.item() == 1000.0


def test_output_dtypes():
    v = torch.randn(2, 2, 3, 8, dtype=torch.bfloat16)
    o, lse = merge_states(v, torch.randn(2, 2, 3))
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert merge_states(v[:, :0], torch.randn(2, 0, 3))[1].eq(-INF).all()


def test_equal_lse_averages():
    v_a, v_b = torch.zeros(1, 1, 2), torch.full((1, 1, 2), 2.0)
    s = torch.tensor([[3.0]])
    o, lse = merge_state(v_a, s, v_b, s)
    assert torch.allclose(o, torch.ones(1, 1, 2)) and torch.allclose(lse, torch.tensor([[4.0]]))  # 3 + log2(2)


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize(
    "args, match",
    [
        ((_r(2, 3, 8), _r(2, 4), _r(2, 3, 8), _r(2, 3)), r"s_a must have shape \(2, 3\).*got \(2, 4\)"),
        ((_r(2, 3, 8), _r(2, 3), _r(2, 3, 4), _r(2, 3)), r"v_b must have the shape of v_a \(2, 3, 8\), got \(2, 3, 4\)"),
        ((_r(3, 8), _r(3), _r(3, 8), _r(3)), r"v_a must have 3 dims, got shape \(3, 8\)"),
        ((_r(2, 3, 8), _r(2, 3, dtype=torch.int32), _r(2, 3, 8), _r(2, 3)), r"s_a must be a floating-point"),
        ((_r(2, 3, 8), _r(2, 3), _r(2, 3, 8, dtype=torch.float16), _r(2, 3)), r"v_b must have v_a's dtype"),
    ],
)
def test_merge_state_argument_errors(args, match):
    with pytest.raises(ValueError, match=match):
        merge_state(*args)


def test_merge_states_argument_errors():
    with pytest.raises(ValueError, match=r"v must have 4 dims, got shape \(2, 3, 8\)"):
        merge_states(torch.randn(2, 3, 8), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"s must have shape \(2, 5, 3\).*got \(2, 3\)"):
        merge_states(torch.randn(2, 5, 3, 8), torch.randn(2, 3))
    with pytest.raises(ValueError, match="v must be a torch.Tensor"):
        merge_states([[1.0]], torch.randn(1))
