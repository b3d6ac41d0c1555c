"""backend="auto" for prefill (and tensor-core decode): fa3 exactly when the targets include
sm90a and every rule passes for the fa3 version of the spec, else fa2; an explicit fa3 that a
rule refuses raises with that rule's message and suggestion. The device is simulated through
the target archs, so this runs without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge import dispatch
from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import RULES, RULES_BY_ID, UnsupportedSpecError, check
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding

FA3_RULES = sorted(rule.id for rule in RULES if rule.id.startswith("fa3-"))


@st.composite
def prefill_specs(draw) -> KernelSpec:
    dims = draw(st.sampled_from([(64, 64), (128, 128), (256, 256), (192, 128), (96, 96), (512, 512)]))
    dtype_q = draw(st.sampled_from(list(DType)))
    return KernelSpec(
        kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=dtype_q,
        dtype_kv=draw(st.sampled_from([dtype_q, *DType])), dtype_o=draw(st.sampled_from([DType.BF16, DType.FP16])),
        head_dim_qk=dims[0], head_dim_vo=dims[1], pos_encoding=draw(st.sampled_from(list(PosEncoding))),
        use_sliding_window=draw(st.booleans()), use_logits_soft_cap=draw(st.booleans()),
        use_custom_mask=draw(st.booleans()), fp16_qk_reduction=draw(st.booleans()),
        archs=(draw(st.sampled_from([Arch.SM80, Arch.SM89, Arch.SM90A])),))


@settings(max_examples=300, deadline=None)
@given(prefill_specs())
def test_auto_picks_fa3_exactly_when_every_fa3_rule_passes(spec):
    fa3 = dataclasses.replace(spec, backend=Backend.FA3, archs=(Arch.SM90A,))
    fa3_ok = Arch.SM90A in spec.archs and not check(fa3)
    fa2_ok = not check(dataclasses.replace(spec, backend=Backend.FA2))
    if not fa3_ok and not fa2_ok:
        with pytest.raises(UnsupportedSpecError):
            dispatch.resolve_backend("auto", spec)
        return
    resolved = dispatch.resolve_backend("auto", spec)
    assert resolved.backend is (Backend.FA3 if fa3_ok else Backend.FA2)
    assert check(resolved) == []


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_auto_is_fa2_at_head_dim_512_on_hopper(dtype):
    """fa3 refuses 512 (fa3-head-dim-512): auto prefill and tensor-core decode run fa2 there."""
    spec = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=dtype, dtype_kv=dtype, dtype_o=dtype,
                      head_dim_qk=512, head_dim_vo=512, archs=(Arch.SM90A,))
    assert dispatch.resolve_backend("auto", spec).backend is Backend.FA2


@pytest.mark.parametrize("arch", [Arch.SM80, Arch.SM86, Arch.SM89])
def test_auto_is_fa2_before_hopper(arch):
    spec = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(arch,))
    assert dispatch.resolve_backend("auto", spec).backend is Backend.FA2


@pytest.mark.parametrize("dtype_kv", [DType.E4M3, DType.E5M2])
def test_auto_falls_back_to_fa2_for_16bit_q_with_fp8_kv_on_hopper(dtype_kv):
    """FlashInfer #2148/#2536: bf16 q with an fp8 cache is not an fa3 configuration; fa2 widens the
    cache in the kernel."""
    spec = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=dtype_kv,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))
    fa3 = dataclasses.replace(spec, backend=Backend.FA3)
    assert "fa3-fp8-kv-needs-fp8-q" in [r.id for r in check(fa3)]
    resolved = dispatch.resolve_backend("auto", spec)
    assert resolved.backend is Backend.FA2 and resolved.dtype_kv is dtype_kv


@pytest.mark.parametrize("rule_id, change", [
    ("fa3-fp8-kv-needs-fp8-q", dict(dtype_kv=DType.E4M3)),
    ("fa3-no-custom-mask", dict(use_custom_mask=True)),
    ("fa3-no-pos-encoding", dict(pos_encoding=PosEncoding.ROPE_LLAMA)),
    ("fa3-head-dims", dict(head_dim_qk=144, head_dim_vo=144)),
    ("fa3-head-dim-512", dict(head_dim_qk=512, head_dim_vo=512)),
    ("fa3-needs-sm90a", dict(archs=(Arch.SM80,))),
    ("fa3-fp8-head-dims", dict(dtype_q=DType.E4M3, dtype_kv=DType.E4M3, head_dim_qk=80, head_dim_vo=80)),
])
def test_explicit_fa3_is_refused_with_the_rule_and_its_suggestion(rule_id, change):
    spec = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))
    spec = dataclasses.replace(spec, **change)
    with pytest.raises(UnsupportedSpecError) as info:
        dispatch.resolve_backend("fa3", spec)
    rule = RULES_BY_ID[rule_id]
    assert rule_id in info.value.rule_ids
    assert rule.suggestion.format(s=info.value.spec) in str(info.value)


def test_every_fa3_rule_is_exercised_above():
    covered = {"fa3-fp8-kv-needs-fp8-q", "fa3-no-custom-mask", "fa3-no-pos-encoding", "fa3-head-dims",
               "fa3-needs-sm90a", "fa3-only-sm90a", "fa3-same-dtype-family",
               "fa3-fp8-head-dims", "fa3-head-dim-512"}
    assert set(FA3_RULES) <= covered, f"add a selection test for {set(FA3_RULES) - covered}"


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
def test_auto_picks_fa3_for_an_fp8_query_and_cache_on_hopper(fp8):
    """Issue 5's selection: fp8 q + fp8 KV (either format) on sm90 runs on fa3, whose fp8 wgmma
    takes both; before Hopper no kernel serves it and auto refuses."""
    spec = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA2, dtype_q=fp8, dtype_kv=fp8, dtype_o=DType.BF16,
                      head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))
    assert dispatch.resolve_backend("auto", spec).backend is Backend.FA3
    with pytest.raises(UnsupportedSpecError):
        dispatch.resolve_backend("auto", dataclasses.replace(spec, archs=(Arch.SM80,)))
