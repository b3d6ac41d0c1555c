"""Manifest expansion: cartesian products, shorthands, the rules filter, and readable errors."""

from __future__ import annotations

import pytest

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
    out = expand(one_group(dtype_q="bf16", head_dim=[96, 128]))
    assert [s.head_dim_qk for s in out.specs] == [128]
    ((spec, violations),) = out.refused
    assert spec.head_dim_qk == 96 and [r.id for r in violations] == ["decode-head-dims"]


def test_on_invalid_error_names_the_rule():
    with pytest.raises(ManifestError, match="decode-head-dims"):
        expand(one_group(dtype_q="bf16", head_dim=[96, 128], on_invalid="error"))


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
