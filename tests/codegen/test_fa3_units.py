"""How an FA3 prefill module is spread over translation units (codegen/fa3_units.py): each kernel
instantiation the launcher can pick is compiled in exactly one unit, and only units whose tiles need
CuTe's extended wgmma widths parse those headers; the tiles' swizzle lines fit the head dims. No compiler runs here; the rendered static_asserts
check the same values against fa3/traits.cuh at build time."""

from __future__ import annotations

import re

import pytest

from attnforge.codegen import manifest, render
from attnforge.codegen.dtypes import DType
from attnforge.codegen.fa3_units import CUTE_BASE_WGMMA_WIDTHS, INSTANCES, fa3_kv_tile, fa3_line_bytes, fa3_tile_dim
from attnforge.codegen.rules import FA3_FP8_PREFILL_HEAD_DIMS, FA3_PREFILL_HEAD_DIMS, check
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind

EXTENDED = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"
FA3_SPECS = [spec for spec in manifest.load(manifest.default_manifest_path()).specs if spec.backend is Backend.FA3]
_INSTANCE = re.compile(r"^(extern )?template cudaError_t attnforge::fa3::launch_instance<([^\n]+)>\(", re.M)


def _instantiations(text: str) -> tuple[set[str], set[str]]:
    """The launch_instance types a unit declares `extern template` and those it instantiates."""
    found = _INSTANCE.findall(text)
    return {t for extern, t in found if extern}, {t for extern, t in found if not extern}


@pytest.mark.parametrize("spec", FA3_SPECS, ids=[s.name for s in FA3_SPECS])
def test_every_instantiation_the_launchers_skip_is_compiled_in_exactly_one_other_unit(spec):
    units = {name: text for name, text in render.render(spec).files.items() if name.endswith(".cu")}
    declared = {name: _instantiations(text)[0] for name, text in units.items()}
    defined = {name: _instantiations(text)[1] for name, text in units.items()}
    for launcher, externs in declared.items():
        # The traits alias is each variant's own: an instance unit belongs to the launcher it is named after.
        own = {name: types for name, types in defined.items() if name.startswith(launcher.removesuffix(".cu") + "_")}
        for traits in externs:
            holders = [name for name, types in own.items() if traits in types]
            assert len(holders) == 1, (launcher, traits, holders)
        assert set().union(*own.values()) == externs, f"{launcher}: its instance units compile what it launches"
    for name, types in defined.items():
        assert len(types) <= 1, f"{name} compiles {len(types)} instantiations; one per unit builds them in parallel"
        assert not (types and declared[name]), f"{name} both launches and instantiates"
    assert sum(map(len, defined.values())) == sum(map(len, declared.values())), "no instantiation without a launcher"


@pytest.mark.parametrize("spec", FA3_SPECS, ids=[s.name for s in FA3_SPECS])
def test_launchers_check_every_instance_flag_against_the_traits(spec):
    module = render.render(spec)
    for variant in render.module_layout(spec).variants:
        text = module.files[f"{variant.name}.cu"]
        for instance in INSTANCES:
            compiled = instance in variant.instances
            assert f"static_assert(PrefillTraitsFa3::{instance.flag} == {str(compiled).lower()}," in text


@pytest.mark.parametrize("spec", FA3_SPECS, ids=[s.name for s in FA3_SPECS])
def test_only_units_with_an_extended_wgmma_width_parse_those_headers(spec):
    module = render.render(spec)
    for variant in render.module_layout(spec).variants:
        paged = dict(variant.context)["paged"]
        widths = {fa3_kv_tile(spec, paged), fa3_tile_dim(spec, spec.head_dim_vo)}
        names = [f"{variant.name}.cu"] + [f"{variant.name}_{i.name}.cu" for i in variant.instances]
        for name in names:
            text = module.files[name]
            assert (EXTENDED in text) == (not widths <= CUTE_BASE_WGMMA_WIDTHS), name
            assert f"kBlockN == {fa3_kv_tile(spec, paged)}," in text, "the unit checks the kv tile it was rendered for"
            if EXTENDED in text:
                assert text.index(EXTENDED) < text.index("#include"), "the macro must precede every CuTe include"


def test_the_default_manifest_has_units_of_both_kinds():
    """Both branches above are exercised: some unit needs the extended widths, most do not."""
    texts = [text for spec in FA3_SPECS for name, text in render.render(spec).files.items() if name.endswith(".cu")]
    extended = sum(EXTENDED in text for text in texts)
    assert 0 < extended < len(texts) // 4


def _fa3(dtype: DType, qk: int, vo: int) -> KernelSpec:
    out = DType.BF16 if dtype.is_fp8 else dtype
    return KernelSpec(kind=Kind.PREFILL, backend=Backend.FA3, dtype_q=dtype, dtype_kv=dtype, dtype_o=out,
                      head_dim_qk=qk, head_dim_vo=vo, archs=(Arch.SM90A,))


ACCEPTED = [_fa3(DType.BF16, qk, vo) for qk, vo in sorted(FA3_PREFILL_HEAD_DIMS)]
ACCEPTED += [_fa3(DType.E4M3, qk, vo) for qk, vo in sorted(FA3_FP8_PREFILL_HEAD_DIMS)]


@pytest.mark.parametrize("spec", ACCEPTED, ids=[s.name for s in ACCEPTED])
def test_tiles_are_the_head_dims_in_the_widest_swizzle_lines_that_divide_them(spec):
    """A tile that padded its head dim would run a larger head dim's wgmmas (16-bit hd 80 at 128: 0.62x
    the FLOP rate; fp8 hd 192 at 256 does a third more MMA work)."""
    assert check(spec) == []
    for dim in (spec.head_dim_qk, spec.head_dim_vo):
        line = fa3_line_bytes(spec, dim)
        assert fa3_tile_dim(spec, dim) == dim
        assert line == max(w for w in (32, 64, 128) if dim * spec.dtype_kv.bytes % w == 0), "the widest line that fits"
