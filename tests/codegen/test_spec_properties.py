"""Hypothesis properties over the whole KernelSpec space: names round-trip, uris are injective,
valid specs render deterministically, invalid ones are refused by name before anything is rendered."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge.codegen import render
from attnforge.codegen.dtypes import DType, IndexType
from attnforge.codegen.rules import (FA2_PREFILL_HEAD_DIMS, FA3_PREFILL_HEAD_DIMS, RULES, UnsupportedSpecError,
                                      check)
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding

# Every common head dim and 512 (fa2 only), plus refused ones: off the 16-grid (72), uninstantiated
# (48, 144), too wide (384).
HEAD_DIMS = (48, 64, 72, 80, 96, 112, 128, 144, 160, 192, 224, 256, 384, 512)


@st.composite
def specs(draw, kinds=tuple(Kind), backends=tuple(Backend), dtypes=tuple(DType), pos=tuple(PosEncoding),
          flags=(False, True)) -> KernelSpec:
    """A KernelSpec; the keyword arguments narrow a field's domain (default: all of it)."""
    qk = draw(st.sampled_from(HEAD_DIMS))
    # Equal qk/vo is the common case; drawing it on purpose makes supported specs frequent.
    vo = draw(st.one_of(st.just(qk), st.sampled_from(HEAD_DIMS)))
    return KernelSpec(
        kind=draw(st.sampled_from(kinds)),
        backend=draw(st.sampled_from(backends)),
        dtype_q=draw(st.sampled_from(dtypes)),
        dtype_kv=draw(st.sampled_from(dtypes)),
        dtype_o=draw(st.sampled_from(dtypes)),
        idtype=draw(st.sampled_from(IndexType)),
        head_dim_qk=qk,
        head_dim_vo=vo,
        pos_encoding=draw(st.sampled_from(pos)),
        use_sliding_window=draw(st.booleans()),
        use_logits_soft_cap=draw(st.booleans()),
        use_custom_mask=draw(st.sampled_from(flags)),
        fp16_qk_reduction=draw(st.sampled_from(flags)),
        archs=tuple(draw(st.sets(st.sampled_from(Arch), min_size=1))),
    )


# Near the supported region (what this version builds), so that valid specs are drawn often; every
# field still varies where the rules have something to say, and validity is still decided by check().
NEAR_VALID = specs(kinds=(Kind.DECODE,), backends=(Backend.FA2,), dtypes=(DType.FP16, DType.BF16),
                   pos=(PosEncoding.NONE,), flags=(False,))
ANY_SPEC = st.one_of(specs(), NEAR_VALID)


@settings(deadline=None)
@given(ANY_SPEC)
def test_valid_specs_render_deterministically_and_invalid_ones_are_refused(spec):
    violations = check(spec)
    if violations:
        with pytest.raises(UnsupportedSpecError) as info:
            render.render(spec)
        assert info.value.rule_ids == [r.id for r in violations]
        assert info.value.rule_ids, "an invalid spec must name at least one rule"
        for rule_id in info.value.rule_ids:
            assert rule_id in str(info.value)
    else:
        first, second = render.render(spec), render.render(spec)
        assert first.files == second.files
        assert first.uri == spec.uri
        assert first.translation_units and all(text for text in first.files.values())


@given(specs())
def test_name_and_uri_parse_back_to_the_spec(spec):
    assert KernelSpec.parse_name(spec.name) == spec
    assert KernelSpec.parse_name(spec.uri) == spec


@given(specs())
def test_dict_round_trip(spec):
    assert KernelSpec.from_dict(spec.to_dict()) == spec


@given(st.lists(ANY_SPEC, min_size=2, max_size=30))
def test_uri_and_name_are_injective(drawn):
    distinct = set(drawn)
    assert len({s.uri for s in distinct}) == len(distinct)
    assert len({s.name for s in distinct}) == len(distinct)


@given(specs())
def test_every_rule_renders_for_any_spec(spec):
    # A message placeholder that does not exist would only show up on the spec that trips the rule.
    for rule in RULES:
        text = rule.render(spec)
        assert text.startswith(f"[{rule.id}] ")


def test_near_valid_strategy_reaches_valid_specs():
    # Guards the strategy above: if the rules or the strategy drift apart so that no drawn spec is
    # valid, the render property would silently test only the refusal branch.
    found = []

    @settings(max_examples=200, database=None)
    @given(NEAR_VALID)
    def collect(spec):
        if not check(spec):
            found.append(spec)

    collect()
    assert found


@settings(deadline=None)
@given(specs(kinds=(Kind.PREFILL,), dtypes=(DType.FP16, DType.BF16), pos=(PosEncoding.NONE,), flags=(False,)))
def test_head_dim_refusals_are_exactly_the_head_dim_rules(spec):
    """A 16-bit prefill spec on a valid arch is refused for its head dims by exactly one head-dim
    rule (none when the pair is listed): every refusal has one reason and one alternative."""
    arch = (Arch.SM90A,) if spec.backend is Backend.FA3 else (Arch.SM80,)
    spec = replace(spec, archs=arch, dtype_kv=spec.dtype_q, dtype_o=spec.dtype_q)
    ids = [r.id for r in check(spec)]
    listed = FA3_PREFILL_HEAD_DIMS if spec.backend is Backend.FA3 else FA2_PREFILL_HEAD_DIMS
    if (spec.head_dim_qk, spec.head_dim_vo) in listed:
        assert ids == []
    else:
        assert len(ids) == 1 and ids[0] in {"head-dims-multiple-of-16", "prefill-head-dims-max-256",
                                             "fa3-head-dims", "fa2-prefill-head-dims", "fa3-head-dim-512"}, ids
