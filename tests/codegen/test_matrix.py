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


def test_supported_decode_rows():
    supported = {(r.spec.dtype_q, r.spec.head_dim_qk) for r in matrix.rows([Kind.DECODE], [Backend.FA2]) if r.supported}
    assert supported == {(d, hd) for d in (DType.FP16, DType.BF16) for hd in (64, 128, 256)}


def test_markdown_has_one_line_per_row_and_names_rules():
    rows = matrix.rows([Kind.PREFILL], [Backend.FA3])
    text = matrix.markdown(rows)
    assert len(text.splitlines()) == len(rows) + 2
    assert "fa3-fp8-kv-needs-fp8-q" in text


def test_default_dtype_o():
    assert DType.E4M3.default_output is DType.BF16
    assert DType.FP16.default_output is DType.FP16
