"""The rules table: every rule fires on an example, and the FlashInfer behaviours it encodes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import (FA2_FP8_KV_PREFILL_HEAD_DIMS, HEAD_DIMS, RULES, RULES_BY_ID, UnsupportedSpecError, check,
                                      ensure_valid)
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind, PosEncoding

FA3 = dict(backend=Backend.FA3, kind=Kind.PREFILL, archs=(Arch.SM90A,))

# One change to the valid decode spec per rule id, enough to make that rule fire.
EXAMPLES = {
    "o-not-fp8": dict(dtype_o=DType.E4M3),
    "no-archs": dict(archs=()),
    "mixed-16bit-qkv": dict(dtype_kv=DType.FP16),
    "fp8-q-needs-fp8-kv": dict(dtype_q=DType.E4M3),
    "fa2-no-fp8-q": dict(dtype_q=DType.E4M3, dtype_kv=DType.E4M3),
    "fa3-needs-sm90a": dict(FA3, archs=(Arch.SM80,)),
    "fa3-only-sm90a": dict(FA3, archs=(Arch.SM80, Arch.SM90A)),
    "fa3-fp8-kv-needs-fp8-q": dict(FA3, dtype_kv=DType.E4M3),
    "fa3-same-dtype-family": dict(FA3, dtype_q=DType.E4M3, dtype_kv=DType.E5M2),
    "fa3-no-custom-mask": dict(FA3, use_custom_mask=True),
    "fa3-no-pos-encoding": dict(FA3, pos_encoding=PosEncoding.ROPE_LLAMA),
    "fa3-head-dims": dict(FA3, head_dim_qk=144, head_dim_vo=144),
    "fa2-prefill-head-dims": dict(kind=Kind.PREFILL, head_dim_qk=128, head_dim_vo=192),
    "head-dims-multiple-of-16": dict(head_dim_qk=72, head_dim_vo=72),
    "prefill-head-dims-max-256": dict(kind=Kind.PREFILL, head_dim_qk=384, head_dim_vo=384),
    "fa3-head-dim-512": dict(FA3, head_dim_qk=512, head_dim_vo=512),
    "fa2-head-dim-512-smem": dict(kind=Kind.PREFILL, head_dim_qk=512, head_dim_vo=512, archs=(Arch.SM80, Arch.SM86)),
    "fa2-fp8-kv-head-dims": dict(kind=Kind.PREFILL, dtype_kv=DType.E4M3, head_dim_qk=80, head_dim_vo=80),
    "no-fp16-qk-reduction": dict(dtype_q=DType.FP16, dtype_kv=DType.FP16, fp16_qk_reduction=True),
    "decode-is-fa2": dict(backend=Backend.FA3, archs=(Arch.SM90A,)),
    "decode-head-dims": dict(head_dim_qk=192, head_dim_vo=128),
    "decode-no-custom-mask": dict(use_custom_mask=True),
    "fa3-fp8-head-dims": dict(FA3, dtype_q=DType.E4M3, dtype_kv=DType.E4M3, head_dim_qk=80, head_dim_vo=80),
}


def test_every_rule_has_an_example():
    assert set(EXAMPLES) == set(RULES_BY_ID), "add an example for each new rule (and drop removed ones)"


@pytest.mark.parametrize("rule_id", sorted(EXAMPLES))
def test_rule_fires(decode_spec, rule_id):
    spec = replace(decode_spec, **EXAMPLES[rule_id])
    assert rule_id in [r.id for r in check(spec)]
    with pytest.raises(UnsupportedSpecError) as info:
        ensure_valid(spec)
    assert rule_id in info.value.rule_ids


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_fa3_fp8_prefill_is_valid(decode_spec, head_dim, fp8):
    """Issue 38: fp8 fa3 at the common head dims, 64 and 96 on the hd 128 tiles, 192 on hd 256's."""
    spec = replace(decode_spec, **FA3, dtype_q=fp8, dtype_kv=fp8, dtype_o=DType.BF16,
                   head_dim_qk=head_dim, head_dim_vo=head_dim)
    assert check(spec) == []


@pytest.mark.parametrize("dims", [(80, 80), (112, 112), (160, 160), (224, 224), (192, 128), (128, 64)])
def test_fa3_fp8_refuses_unlisted_dims_and_lists_the_others(decode_spec, dims):
    spec = replace(decode_spec, **FA3, dtype_q=DType.E4M3, dtype_kv=DType.E4M3, dtype_o=DType.BF16,
                   head_dim_qk=dims[0], head_dim_vo=dims[1])
    with pytest.raises(UnsupportedSpecError) as info:
        ensure_valid(spec)
    assert info.value.rule_ids == ["fa3-fp8-head-dims"]
    assert "use head dims 64, 96, 128, 192, 256," in str(info.value)


def test_valid_decode_spec_passes(decode_spec):
    assert check(decode_spec) == []
    assert ensure_valid(decode_spec) is decode_spec


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("pos_encoding", list(PosEncoding))
def test_fa2_prefill_variants_pass(decode_spec, dims, pos_encoding):
    spec = replace(decode_spec, kind=Kind.PREFILL, head_dim_qk=dims[0], head_dim_vo=dims[1], pos_encoding=pos_encoding,
                   use_custom_mask=True, use_sliding_window=True, use_logits_soft_cap=True)
    assert check(spec) == []


def test_rules_are_complete_rows():
    assert len({r.id for r in RULES}) == len(RULES)
    for rule in RULES:
        assert rule.id and rule.message.strip() and rule.suggestion.strip()


def test_check_returns_every_violation_not_the_first(decode_spec):
    spec = replace(decode_spec, dtype_o=DType.E4M3, head_dim_qk=384, head_dim_vo=384, use_custom_mask=True)
    assert {"o-not-fp8", "decode-head-dims", "decode-no-custom-mask"} <= {r.id for r in check(spec)}


# FlashInfer #2148/#2536: fa3 cannot take fp8 KV with a 16-bit query (auto falls back to fa2).
@pytest.mark.parametrize("dtype_q", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("dtype_kv", [DType.E4M3, DType.E5M2])
def test_fa3_refuses_fp8_kv_with_16bit_q_but_fa2_does_not(decode_spec, dtype_q, dtype_kv):
    base = replace(decode_spec, kind=Kind.PREFILL, dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_q)
    fa3 = replace(base, backend=Backend.FA3, archs=(Arch.SM90A,))
    fa2 = replace(base, backend=Backend.FA2, archs=(Arch.SM80,))
    assert "fa3-fp8-kv-needs-fp8-q" in [r.id for r in check(fa3)]
    assert "fa3-fp8-kv-needs-fp8-q" not in [r.id for r in check(fa2)]


@pytest.mark.parametrize("dtype_q", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("dtype_kv", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("arch", [Arch.SM80, Arch.SM90A])
def test_fa2_decode_accepts_a_16bit_query_with_an_fp8_cache(decode_spec, dtype_q, dtype_kv, head_dim, arch):
    """The CUDA-core decode kernel dequantizes fp8 K/V on load (issue 5, FlashInfer's fa2 fallback)."""
    spec = replace(decode_spec, dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_q, head_dim_qk=head_dim,
                   head_dim_vo=head_dim, archs=(arch,))
    assert check(spec) == []


@pytest.mark.parametrize("dtype_q", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("dtype_kv", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("dims", sorted(FA2_FP8_KV_PREFILL_HEAD_DIMS))
@pytest.mark.parametrize("arch", [Arch.SM80, Arch.SM90A])
def test_fa2_prefill_accepts_a_16bit_query_with_an_fp8_cache(decode_spec, dtype_q, dtype_kv, dims, arch):
    """The tensor-core prefill kernel widens fp8 K/V to the query's type in shared memory (issue 5),
    with every variant flag; so tensor-core decode takes an fp8 cache too."""
    spec = replace(decode_spec, kind=Kind.PREFILL, dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_q,
                   head_dim_qk=dims[0], head_dim_vo=dims[1], archs=(arch,), use_custom_mask=True,
                   use_sliding_window=True, use_logits_soft_cap=True)
    assert check(spec) == []


def test_fa3_accepts_fp8_kv_with_the_same_fp8_q(decode_spec):
    spec = replace(decode_spec, kind=Kind.PREFILL, backend=Backend.FA3, archs=(Arch.SM90A,),
                   dtype_q=DType.E4M3, dtype_kv=DType.E4M3, dtype_o=DType.BF16)
    ids = {r.id for r in check(spec)}
    assert not ids & {"fa3-fp8-kv-needs-fp8-q", "fa3-same-dtype-family", "o-not-fp8"}


@pytest.mark.parametrize("dtype_o", [d for d in DType if d.is_fp8])
@pytest.mark.parametrize("backend", list(Backend))
def test_fp8_output_is_refused(decode_spec, dtype_o, backend):
    spec = replace(decode_spec, backend=backend, dtype_o=dtype_o)
    assert "o-not-fp8" in [r.id for r in check(spec)]
    assert "o-not-fp8" in str(pytest.raises(UnsupportedSpecError, ensure_valid, spec).value)


# One rule per cause (issue 39): the rules printed together never give advice that contradicts another's.
@st.composite
def any_spec(draw) -> KernelSpec:
    dims = draw(st.sampled_from([(64, 64), (128, 128), (256, 256), (192, 128), (96, 96)]))
    return KernelSpec(
        kind=draw(st.sampled_from(list(Kind))), backend=draw(st.sampled_from(list(Backend))),
        dtype_q=draw(st.sampled_from(list(DType))), dtype_kv=draw(st.sampled_from(list(DType))),
        dtype_o=draw(st.sampled_from(list(DType))), head_dim_qk=dims[0], head_dim_vo=dims[1],
        pos_encoding=draw(st.sampled_from(list(PosEncoding))), use_sliding_window=draw(st.booleans()),
        use_logits_soft_cap=draw(st.booleans()), use_custom_mask=draw(st.booleans()),
        fp16_qk_reduction=draw(st.booleans()),
        archs=tuple(draw(st.sets(st.sampled_from(list(Arch)), max_size=3))))


@settings(max_examples=400, deadline=None)
@given(any_spec())
def test_a_family_rule_fires_only_on_its_own_family(spec):
    """A rule named for a kernel family (fa2-, fa3-, decode-, prefill-) describes that family; it never refuses a
    spec of another one (as when fa3 specs were refused by "the fa2 prefill kernel"). fa3 is a prefill family, so
    an fa3 decode spec gets decode-is-fa2 and the decode rules, never fa3 advice on top."""
    for rule in check(spec):
        if rule.id.startswith("fa2-"):
            assert spec.backend is Backend.FA2, rule.id
        if rule.id.startswith("fa3-"):
            assert spec.backend is Backend.FA3 and spec.kind is Kind.PREFILL, rule.id
        if rule.id.startswith("decode-"):
            assert spec.kind is Kind.DECODE, rule.id
        if rule.id.startswith("prefill-"):
            assert spec.kind is Kind.PREFILL, rule.id


@settings(max_examples=400, deadline=None)
@given(any_spec())
def test_exclusive_causes_give_one_rule(spec):
    ids = {rule.id for rule in check(spec)}
    assert len(ids & {"fa3-needs-sm90a", "fa3-only-sm90a"}) <= 1
    assert len(ids & {"fa3-head-dims", "fa3-fp8-head-dims"}) <= 1
    assert sum("fp16" in rule.message or "fp16_qk" in rule.suggestion for rule in check(spec)
               if "qk" in rule.id) <= 1


def test_fa3_for_sm80_gets_one_arch_rule(decode_spec):
    """Issue 39: fa3 with --arch 80 printed fa3-needs-sm90a ("add sm90a") and fa3-only-sm90a ("only sm90a")."""
    spec = replace(decode_spec, **{**FA3, "archs": (Arch.SM80,)})
    (rule,) = check(spec)
    assert rule.id == "fa3-needs-sm90a"
    assert "add sm90a" not in rule.suggestion and "sm90a alone" in rule.suggestion
    mixed = replace(spec, archs=(Arch.SM80, Arch.SM90A))
    assert [r.id for r in check(mixed)] == ["fa3-only-sm90a"]


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("backend", list(Backend))
@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
def test_fp16_qk_reduction_is_one_rule_that_names_no_family(decode_spec, kind, backend, dtype):
    """Issue 39: four rules refused it (one naming "the fa2 prefill kernel" on fa3); no kernel has the path."""
    archs = FA3["archs"] if backend is Backend.FA3 else (Arch.SM80,)
    spec = replace(decode_spec, kind=kind, backend=backend, archs=archs, dtype_q=dtype, dtype_kv=dtype, dtype_o=dtype,
                   fp16_qk_reduction=True)
    qk_rules = [r for r in check(spec) if "qk" in r.id]
    assert [r.id for r in qk_rules] == ["no-fp16-qk-reduction"]
    assert "fa2" not in qk_rules[0].message and "fa3" not in qk_rules[0].message


def test_fa3_decode_is_refused_by_decode_is_fa2_without_fa3_advice(decode_spec):
    spec = replace(decode_spec, backend=Backend.FA3, archs=(Arch.SM80,), dtype_kv=DType.E4M3, use_custom_mask=True)
    assert [r.id for r in check(spec)] == ["decode-is-fa2", "decode-no-custom-mask"]


NEW_HEAD_DIMS = (80, 96, 112, 160, 192, 224)


@pytest.mark.parametrize("head_dim", NEW_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_new_head_dims_pass_every_16bit_family(decode_spec, head_dim, dtype):
    base = replace(decode_spec, dtype_q=dtype, dtype_kv=dtype, dtype_o=dtype, head_dim_qk=head_dim, head_dim_vo=head_dim)
    assert check(base) == []  # fa2 decode
    assert check(replace(base, kind=Kind.PREFILL)) == []  # fa2 prefill (and tensor-core decode)
    assert check(replace(base, **FA3)) == []
    assert check(replace(base, kind=Kind.PREFILL, use_sliding_window=True, use_logits_soft_cap=True,
                         use_custom_mask=True, pos_encoding=PosEncoding.ROPE_LLAMA)) == []


@pytest.mark.parametrize("head_dim", NEW_HEAD_DIMS)
@pytest.mark.parametrize("dtype_kv", [DType.E4M3, DType.E5M2])
def test_fp8_caches_at_new_head_dims(decode_spec, head_dim, dtype_kv):
    """Decode dequantizes any head dim; fa2 prefill needs multiples of 32; fa3 fp8 takes 96 and 192 of them."""
    base = replace(decode_spec, dtype_kv=dtype_kv, head_dim_qk=head_dim, head_dim_vo=head_dim)
    assert check(base) == []
    prefill = [r.id for r in check(replace(base, kind=Kind.PREFILL))]
    assert prefill == ([] if head_dim % 32 == 0 else ["fa2-fp8-kv-head-dims"])
    fa3 = [r.id for r in check(replace(base, **FA3, dtype_q=dtype_kv, dtype_o=DType.BF16))]
    assert fa3 == ([] if head_dim in (96, 192) else ["fa3-fp8-head-dims"])


@pytest.mark.parametrize(("kind", "backend", "dims", "rule_id", "words"), [
    (Kind.DECODE, Backend.FA2, (100, 100), "head-dims-multiple-of-16", ["not multiples of 16", "zero-pad", "112"]),
    (Kind.PREFILL, Backend.FA2, (72, 72), "head-dims-multiple-of-16", ["qk 72, vo 72", "80"]),
    (Kind.PREFILL, Backend.FA3, (384, 384), "prefill-head-dims-max-256", ["fa3 prefill", "above head dim 256",
                                                                          "up to 256"]),
    (Kind.PREFILL, Backend.FA2, (384, 384), "prefill-head-dims-max-256", ["fa2 prefill", "registers", "but 512"]),
    (Kind.PREFILL, Backend.FA3, (512, 512), "fa3-head-dim-512", ["head dim 512", "256 registers", "backend fa2"]),
    (Kind.PREFILL, Backend.FA2, (512, 256), "prefill-head-dims-max-256", ["qk 512, vo 256"]),
    (Kind.PREFILL, Backend.FA3, (144, 144), "fa3-head-dims", ["qk 144, vo 144", "160", "qk >= vo", "backend fa2"]),
    (Kind.PREFILL, Backend.FA2, (128, 192), "fa2-prefill-head-dims", ["qk 128, vo 192", "224", "qk >= vo"]),
    (Kind.DECODE, Backend.FA2, (384, 384), "decode-head-dims", ["qk 384, vo 384", "qk and vo equal", "512"]),
    (Kind.DECODE, Backend.FA2, (192, 128), "decode-head-dims", ["vo 128", "use_tensor_cores=True"]),
    # off the 16-grid and wider than every listed dim: the width rule alone (nothing to pad to)
    (Kind.PREFILL, Backend.FA2, (264, 264), "prefill-head-dims-max-256", ["qk 264, vo 264", "up to 256"]),
    (Kind.PREFILL, Backend.FA3, (520, 520), "prefill-head-dims-max-256", ["fa3 prefill", "above head dim 256"]),
    (Kind.DECODE, Backend.FA2, (300, 300), "decode-head-dims", ["qk 300, vo 300", "256"]),
])
def test_head_dim_refusals_say_why_and_what_instead(decode_spec, kind, backend, dims, rule_id, words):
    archs = (Arch.SM90A,) if backend is Backend.FA3 else (Arch.SM80,)
    spec = replace(decode_spec, kind=kind, backend=backend, archs=archs, head_dim_qk=dims[0], head_dim_vo=dims[1])
    with pytest.raises(UnsupportedSpecError) as info:
        ensure_valid(spec)
    assert info.value.rule_ids == [rule_id]
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("dims", [(72, 72), (512, 512), (264, 128)])
def test_fa3_fp8_head_dims_are_refused_by_its_own_rule_alone(decode_spec, dims):
    """fa3 fp8 lists its own few dims: off-grid or too wide, one rule says so, with its alternatives."""
    spec = replace(decode_spec, kind=Kind.PREFILL, backend=Backend.FA3, archs=(Arch.SM90A,), dtype_q=DType.E4M3,
                   dtype_kv=DType.E4M3, dtype_o=DType.BF16, head_dim_qk=dims[0], head_dim_vo=dims[1])
    with pytest.raises(UnsupportedSpecError) as info:
        ensure_valid(spec)
    assert info.value.rule_ids == ["fa3-fp8-head-dims"]
    assert "128" in str(info.value) and "16-bit" in str(info.value)


# ---------------------------------------------------------------------------------------
# position encodings: the fa2 decode kernel takes RoPE and ALiBi (issue 38); the refusals left


@pytest.mark.parametrize("dtype_kv", [DType.BF16, DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("pos_encoding", [PosEncoding.ROPE_LLAMA, PosEncoding.ALIBI])
@pytest.mark.parametrize("head_dim", [64, 80, 112, 128, 256])
def test_fa2_decode_takes_pos_encodings(decode_spec, dtype_kv, pos_encoding, head_dim):
    spec = replace(decode_spec, dtype_kv=dtype_kv, pos_encoding=pos_encoding, head_dim_qk=head_dim,
                   head_dim_vo=head_dim, use_logits_soft_cap=True, use_sliding_window=True)
    assert check(spec) == []
    assert "decode-no-pos-encoding" not in RULES_BY_ID


def test_fa3_decode_with_rope_is_refused_once_with_the_fa2_alternative(decode_spec):
    spec = replace(decode_spec, backend=Backend.FA3, archs=(Arch.SM90A,), pos_encoding=PosEncoding.ROPE_LLAMA)
    assert [r.id for r in check(spec)] == ["decode-is-fa2"]
    assert "use backend fa2 for kind decode" in str(_error(spec))


def test_fa3_prefill_pos_encoding_refusal_names_reason_and_alternative(decode_spec):
    spec = replace(decode_spec, **FA3, pos_encoding=PosEncoding.ALIBI)
    message = str(_error(spec))
    assert "[fa3-no-pos-encoding] fa3 kernels have no in-kernel positional encoding; pos_encoding is ALIBI" in message
    assert "or backend fa2" in message


@pytest.mark.parametrize("dtype_kv", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("dims", sorted(FA2_FP8_KV_PREFILL_HEAD_DIMS))
def test_fa2_fp8_prefill_takes_rope(decode_spec, dtype_kv, dims):
    """fa2 prefill (and the tensor-core decode it serves) rotates an fp8 K tile into an fp16 copy
    (issue 38): RoPE over an fp8 cache is accepted at every head-dim pair fp8 prefill has, with the
    other variant flags too; the rule that refused it is gone."""
    spec = replace(decode_spec, kind=Kind.PREFILL, dtype_kv=dtype_kv, head_dim_qk=dims[0], head_dim_vo=dims[1],
                   pos_encoding=PosEncoding.ROPE_LLAMA)
    assert check(spec) == []
    assert check(replace(spec, use_sliding_window=True, use_logits_soft_cap=True, use_custom_mask=True)) == []
    assert "fa2-fp8-kv-no-rope" not in RULES_BY_ID


def test_fp8_rope_prefill_is_still_refused_off_its_head_dims(decode_spec):
    """What stays refused is the fp8 head-dim rule's, not RoPE's: hd 80 is not a multiple of 32."""
    spec = replace(decode_spec, kind=Kind.PREFILL, dtype_kv=DType.E4M3, head_dim_qk=80, head_dim_vo=80,
                   pos_encoding=PosEncoding.ROPE_LLAMA)
    assert [r.id for r in check(spec)] == ["fa2-fp8-kv-head-dims"]


def _error(spec) -> UnsupportedSpecError:
    with pytest.raises(UnsupportedSpecError) as info:
        ensure_valid(spec)
    return info.value


@pytest.mark.parametrize("backend", [Backend.FA2, Backend.FA3])
def test_prefill_takes_every_qk_at_least_vo_pair(decode_spec, backend):
    """Prefill sizes Q/K and V/O apart: any listed pair with qk >= vo has a 16-bit kernel, vo > qk none."""
    archs = (Arch.SM90A,) if backend is Backend.FA3 else (Arch.SM80,)
    for qk in HEAD_DIMS:
        for vo in HEAD_DIMS:
            spec = replace(decode_spec, kind=Kind.PREFILL, backend=backend, archs=archs, head_dim_qk=qk, head_dim_vo=vo)
            assert (check(spec) == []) == (qk >= vo), (qk, vo)


# ---------------------------------------------------------------------------------------
# head dim 512 (issue 38: Gemma): fa2 decode and prefill, 16-bit and fp8 caches; fa3 refuses it alone


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
@pytest.mark.parametrize("dtype_kv", ["same", DType.E4M3])
@pytest.mark.parametrize("kind", [Kind.DECODE, Kind.PREFILL])
def test_fa2_takes_head_dim_512(decode_spec, dtype, dtype_kv, kind):
    kv = dtype if dtype_kv == "same" else dtype_kv
    for archs in [(Arch.SM80,), (Arch.SM90A,), (Arch.SM80, Arch.SM90A)]:
        spec = replace(decode_spec, kind=kind, dtype_q=dtype, dtype_kv=kv, dtype_o=dtype, head_dim_qk=512,
                       head_dim_vo=512, archs=archs, use_logits_soft_cap=True, use_sliding_window=True)
        assert check(spec) == []


def test_fa2_prefill_512_takes_custom_mask_and_pos_encodings(decode_spec):
    base = replace(decode_spec, kind=Kind.PREFILL, head_dim_qk=512, head_dim_vo=512)
    assert check(replace(base, use_custom_mask=True)) == []
    for pos in (PosEncoding.ROPE_LLAMA, PosEncoding.ALIBI):
        assert check(replace(base, pos_encoding=pos)) == []


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_fa3_refuses_512_by_its_own_rule_alone_naming_fa2(decode_spec, dtype):
    spec = replace(decode_spec, **FA3, dtype_q=dtype, dtype_kv=dtype, dtype_o=dtype, head_dim_qk=512, head_dim_vo=512)
    assert [r.id for r in check(spec)] == ["fa3-head-dim-512"]
    assert "use backend fa2" in str(_error(spec))


@pytest.mark.parametrize("arch", [Arch.SM86, Arch.SM89])
def test_fa2_prefill_512_refuses_small_smem_archs_alone(decode_spec, arch):
    """sm86/sm89 give a CTA 99 KB: the hd 512 prefill tiles (~113 KB) do not fit; decode (48 KB) does."""
    spec = replace(decode_spec, kind=Kind.PREFILL, head_dim_qk=512, head_dim_vo=512, archs=(Arch.SM80, arch))
    assert [r.id for r in check(spec)] == ["fa2-head-dim-512-smem"]
    assert "sm80 or sm90" in str(_error(spec))
    assert check(replace(spec, kind=Kind.DECODE)) == []
    assert check(replace(spec, head_dim_qk=256, head_dim_vo=256)) == []
