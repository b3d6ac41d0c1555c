"""Manifest expansion: cartesian products, shorthands, the rules filter, and readable errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnforge.codegen import manifest
from attnforge.codegen.dtypes import DType
from attnforge.codegen.manifest import ManifestError, expand
from attnforge.codegen.spec import Arch

DECODE = {"kind": "decode", "backend": "fa2", "dtype_kv": "same_as_q", "dtype_o": "same_as_q"}


def one_group(**fields) -> dict:
    return {"group": [{**DECODE, **fields}]}


def test_cartesian_product_counts():
    out = expand(one_group(dtype_q=["bf16", "fp16"], head_dim=[64, 128, 256], archs=["80", "90a"]))
    assert len(out.specs) == 2 * 3 * 2
    assert not out.refused
    assert [s.name for s in out.specs] == sorted(s.name for s in out.specs)


def test_same_as_q_and_head_dim_shorthand():
    out = expand(one_group(dtype_q=["bf16", "fp16"], head_dim=[64, 256]))
    for spec in out.specs:
        assert spec.dtype_kv is spec.dtype_q and spec.dtype_o is spec.dtype_q
        assert spec.head_dim_qk == spec.head_dim_vo
    assert {s.head_dim_qk for s in out.specs} == {64, 256}


def test_plus_joins_archs_into_one_module():
    (spec,) = expand(one_group(dtype_q="bf16", head_dim=128, archs="80+90a")).specs
    assert spec.archs == (Arch.SM80, Arch.SM90A)


def test_defaults_apply_to_every_group():
    data = {"defaults": {**DECODE, "archs": "90a"}, "group": [{"dtype_q": "bf16", "head_dim": 64},
                                                              {"dtype_q": "fp16", "head_dim": 128}]}
    assert {s.archs for s in expand(data).specs} == {(Arch.SM90A,)}


def test_on_invalid_skip_reports_refused_specs():
    out = expand(one_group(dtype_q="bf16", head_dim=[144, 128]))
    assert [s.head_dim_qk for s in out.specs] == [128]
    ((spec, violations),) = out.refused
    assert spec.head_dim_qk == 144 and [r.id for r in violations] == ["decode-head-dims"]


def test_on_invalid_error_names_the_rule():
    with pytest.raises(ManifestError, match="decode-head-dims"):
        expand(one_group(dtype_q="bf16", head_dim=[144, 128], on_invalid="error"))


def test_bad_on_invalid_value():
    with pytest.raises(ManifestError, match="on_invalid"):
        expand(one_group(dtype_q="bf16", head_dim=128, on_invalid="ignore"))


def test_unknown_field():
    with pytest.raises(ManifestError, match="head_dims"):
        expand(one_group(dtype_q="bf16", head_dims=128))


def test_empty_value_list():
    with pytest.raises(ManifestError, match="empty"):
        expand(one_group(dtype_q=[], head_dim=128))


def test_unknown_value_is_a_manifest_error():
    with pytest.raises(ManifestError, match="bf17"):
        expand(one_group(dtype_q="bf17", head_dim=128))


def test_no_group():
    with pytest.raises(ManifestError, match="group"):
        expand({"defaults": DECODE})


def test_duplicates_across_groups_appear_once():
    group = {**DECODE, "dtype_q": "bf16", "head_dim": [64, 128]}
    out = expand({"group": [group, {**group, "head_dim": 128}]})
    assert len(out.specs) == 2 == len(set(out.specs))


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[[group]\nkind = decode\n")
    with pytest.raises(ManifestError, match="not valid TOML"):
        manifest.load(path)


def test_load_reads_toml(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[[group]]\nkind = "decode"\nbackend = "fa2"\ndtype_q = "fp16"\ndtype_kv = "same_as_q"\n'
                    'dtype_o = "same_as_q"\nhead_dim = 64\n')
    (spec,) = manifest.load(path).specs
    assert spec.dtype_q is DType.FP16 and spec.head_dim_vo == 64


def test_default_manifest_is_all_valid():
    out = manifest.load(manifest.default_manifest_path())
    assert out.specs and not out.refused


# Issue 39: every malformed manifest is one line naming the field's path, never a traceback.
VALID_GROUP = '[[group]]\nkind = "decode"\nbackend = "fa2"\ndtype_q = "bf16"\nhead_dim = 128\n'


def load_text(tmp_path, text: str | bytes, name: str = "m.toml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return manifest.load(path)


def error_of(tmp_path, text: str | bytes) -> str:
    with pytest.raises(ManifestError) as info:
        load_text(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message
    return message.removeprefix(f"{tmp_path / 'm.toml'}: ")


@pytest.mark.parametrize("text, message", [
    (b"\xff\xfe[[group]]\n", "not UTF-8 text (byte 0xff on line 1); save the manifest as UTF-8"),
    ("defaults = 3\n" + VALID_GROUP, "defaults: expected a table ([defaults]), got 3"),
    ('group = ["decode"]\n', 'group[0]: expected a table ([[group]]), got "decode"'),
    ('group = "decode"\n', 'group: expected an array of tables ([[group]]), got "decode"'),
    ('[defualts]\nkind = "decode"\n' + VALID_GROUP,
     "unknown top-level [defualts]; did you mean [defaults]? (a manifest holds one [defaults] table and "
     "[[group]] tables)"),
    ('[[groups]]\nkind = "decode"\n', "unknown top-level [[groups]]; did you mean [[group]]?"),
    ('[[group]]\ndtype_q = "bf16"\n', "group[0]: missing kind, backend, head_dim (give them in the group or in "
                                      "[defaults])"),
    (VALID_GROUP + VALID_GROUP.replace("head_dim = 128", 'head_dim = "128"'),
     'group[1].head_dim: expected a positive int, got "128"'),
    (VALID_GROUP.replace("head_dim = 128", "head_dim = [64, 128.0]"),
     "group[0].head_dim[1]: expected a positive int, got 128.0"),
    (VALID_GROUP + "use_sliding_window = \"false\"\n", 'group[0].use_sliding_window: expected true or false, got "false"'),
    (VALID_GROUP.replace('"decode"', '"prefil"'),
     'group[0].kind: unknown kind "prefil"; expected one of prefill, decode'),
    (VALID_GROUP.replace('"fa2"', '"auto"'), 'group[0].backend: unknown backend "auto"; expected one of fa2, fa3'),
    (VALID_GROUP.replace('dtype_q = "bf16"', 'dtype_q = ["bf16", 16]'),
     "group[0].dtype_q[1]: expected a string, got 16"),
    (VALID_GROUP + "archs = [80]\n", 'group[0].archs[0]: expected an arch string such as "90a" or "80+90a", got 80'),
    (VALID_GROUP + 'archs = "75"\n', "group[0].archs: unknown arch '75'; expected one of 80, 86, 89, 90, 90a"),
    ('[defaults]\nhead_dim = true\n' + VALID_GROUP, "defaults.head_dim: expected a positive int, got true"),
    (VALID_GROUP + "head_dims = 64\n", "group[0].head_dims: unknown field; did you mean head_dim?"),
    (VALID_GROUP + "fp16_qk_reduction = false\n",
     "group[0].fp16_qk_reduction: not a manifest field: no kernel accumulates q.k in fp16"),
    (VALID_GROUP + "on_invalid = 1\n", 'group[0].on_invalid: expected "skip" or "error", got 1'),
    (VALID_GROUP + "name = [1]\n", "group[0].name: expected a string, got [1]"),
    (VALID_GROUP + "dtype_kv = []\n", "group[0].dtype_kv: empty list (give at least one value)"),
    (VALID_GROUP + "pos_encoding = { a = 1 }\n", "group[0].pos_encoding: expected a string, got a table {a = 1}"),
    (VALID_GROUP.replace('"fa2"', '"fa3"'),
     'the manifest yields no module: rules refuse all 1 combination(s) (decode-is-fa2 x1); set on_invalid = "error" '
     "in a group to see why"),
])
def test_malformed_manifest_is_one_line_with_the_field_path(tmp_path, text, message):
    assert message in error_of(tmp_path, text)


def test_a_group_takes_its_dtypes_from_the_query_by_default(tmp_path):
    (spec,) = load_text(tmp_path, VALID_GROUP.replace('"bf16"', '"e4m3"').replace('"decode"', '"prefill"')
                        .replace('"fa2"', '"fa3"') + 'archs = "90a"\n').specs
    assert spec.dtype_kv is DType.E4M3 and spec.dtype_o is DType.BF16 and spec.head_dim_vo == 128


TOML_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=4,
).filter(lambda v: v is not None)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted({*manifest._KEYS, "fp16_qk_reduction", "bogus"})), value=TOML_VALUES,
       in_defaults=st.booleans())
def test_any_value_in_any_field_expands_or_raises_one_line(key, value, in_defaults):
    """Hypothesis over malformed values: expand() returns specs or raises a one-line ManifestError naming
    the field; never another exception."""
    group = {"kind": "decode", "backend": "fa2", "dtype_q": "bf16", "head_dim": 128}
    data = {"defaults": {key: value}, "group": [group]} if in_defaults else {"group": [{**group, key: value}]}
    try:
        out = expand(data, "m.toml")
    except ManifestError as exc:
        text = str(exc)
        assert "\n" not in text and text.startswith("m.toml: ")
        assert key in text or "yields no module" in text or "head_dim" in text, text
    else:
        assert out.specs
