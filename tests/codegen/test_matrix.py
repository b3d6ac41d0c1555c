"""The support matrix is the rules table, seen from the user's side."""

from __future__ import annotations

from attnforge.codegen import matrix
from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import check
from attnforge.codegen.spec import Backend, Kind


def test_rows_agree_with_check():
    rows = matrix.rows()
    assert len(rows) == len(Kind) * len(Backend) * len(DType) ** 2 * len(matrix.HEAD_DIMS)
    for row in rows:
        assert row.violations == tuple(r.id for r in check(row.spec))
        assert not row.spec.dtype_o.is_fp8, "the probe specs use the default (never fp8) output dtype"
        assert not {"fa3-needs-sm90a", "fa3-only-sm90a", "no-archs"} & set(row.violations)


COMMON = (64, 80, 96, 112, 128, 160, 192, 224, 256)


def test_supported_decode_rows():
    supported = {(r.spec.dtype_q, r.spec.head_dim_qk) for r in matrix.rows([Kind.DECODE], [Backend.FA2]) if r.supported}
    assert supported == {(d, hd) for d in (DType.FP16, DType.BF16) for hd in COMMON + (512,)}


def _supported_dims(kind, backend, dtype_q, dtype_kv):
    return {(r.spec.head_dim_qk, r.spec.head_dim_vo) for r in matrix.rows([kind], [backend])
            if r.supported and r.spec.dtype_q is dtype_q and r.spec.dtype_kv is dtype_kv}


def test_supported_prefill_head_dims():
    """Every common head dim and the matrix's qk > vo pairs on fa2 and fa3 16-bit, and 512 on fa2; fp8
    fa2 caches at multiples of 32; fa3 fp8 (either format) at 64, 96, 128, 192 and 256, qk = vo."""
    common = {(d, d) for d in COMMON} | {(192, 128), (256, 128), (128, 64)}
    for backend in Backend:
        for dtype in (DType.FP16, DType.BF16):
            wide = {(512, 512)} if backend is Backend.FA2 else set()
            assert _supported_dims(Kind.PREFILL, backend, dtype, dtype) == common | wide
    assert _supported_dims(Kind.PREFILL, Backend.FA2, DType.BF16, DType.E4M3) == {
        dims for dims in common | {(512, 512)} if dims[0] % 32 == 0 and dims[1] % 32 == 0}
    for fp8 in (DType.E4M3, DType.E5M2):
        assert _supported_dims(Kind.PREFILL, Backend.FA3, fp8, fp8) == {(d, d) for d in (64, 96, 128, 192, 256)}


def test_matrix_names_the_rule_of_each_refused_head_dim():
    by_dims = {(r.spec.head_dim_qk, r.spec.head_dim_vo): r.violations
               for r in matrix.rows([Kind.PREFILL], [Backend.FA3]) if r.spec.dtype_q is DType.BF16
               and r.spec.dtype_kv is DType.BF16}
    assert by_dims[(72, 72)] == ("head-dims-multiple-of-16",)
    assert by_dims[(144, 144)] == ("fa3-head-dims",)
    assert by_dims[(512, 512)] == ("fa3-head-dim-512",)
    assert by_dims[(384, 384)] == ("prefill-head-dims-max-256",)
    assert by_dims[(128, 192)] == ("fa3-head-dims",)
    decode = {(r.spec.head_dim_qk, r.spec.head_dim_vo): r.violations
              for r in matrix.rows([Kind.DECODE], [Backend.FA2]) if r.spec.dtype_q is DType.FP16
              and r.spec.dtype_kv is DType.FP16}
    assert decode[(192, 128)] == ("decode-head-dims",)
    assert decode[(384, 384)] == ("decode-head-dims",)
    assert decode[(512, 512)] == ()


def test_markdown_has_one_line_per_row_and_names_rules():
    rows = matrix.rows([Kind.PREFILL], [Backend.FA3])
    text = matrix.markdown(rows)
    assert len(text.splitlines()) == len(rows) + 2
    assert "fa3-fp8-kv-needs-fp8-q" in text


def test_default_dtype_o():
    assert DType.E4M3.default_output is DType.BF16
    assert DType.FP16.default_output is DType.FP16
