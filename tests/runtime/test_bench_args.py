"""Benchmark command lines refuse malformed arguments with a message naming the option (CPU)."""

from __future__ import annotations

import pytest

from attnforge.benchmarks import prefill


def test_prefill_shapes_parse():
    assert prefill.parse_args(["--shapes", "4x4096", "1X16384"]).shapes == [(4, 4096), (1, 16384)]


@pytest.mark.parametrize("bad", ["4by4096", "4x4096x2", "0x128", "4x", "1x-64"])
def test_prefill_shapes_refuse_malformed_items(bad, capsys):
    with pytest.raises(SystemExit) as info:
        prefill.parse_args(["--shapes", bad])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--shapes" in err and "BATCHxLEN" in err and bad in err


def test_prefill_head_dims_pick_the_acceptance_heads():
    assert prefill.parse_args(["--head-dims", "64", "256"]).head_dims == [64, 256]
    assert [prefill.Heads.for_head_dim(d) for d in (128, 256)] == [prefill.Heads(32, 8, 128), prefill.Heads(16, 4, 256)]


def test_prefill_head_dims_refuse_unbenchmarked(capsys):
    with pytest.raises(SystemExit):
        prefill.parse_args(["--head-dims", "144"])
    assert "--head-dims" in capsys.readouterr().err


def test_prefill_head_dims_take_every_supported_dim():
    dims = [64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert prefill.parse_args(["--head-dims", *map(str, dims)]).head_dims == dims
    assert [prefill.Heads.for_head_dim(d) for d in (96, 160)] == [prefill.Heads(32, 8, 96), prefill.Heads(16, 4, 160)]


def test_prefill_markdown_has_a_column_pair_per_decode_path():
    row = prefill.Row(4, 4096, 256, True, 10.0, 8.0, 1.0, 2.0, None, 3.0, None, None)
    decode = [{"group": 4, "max_abs_diff": 0.0, **{f"{key}_{what}": 1.0 for key, _, _ in prefill.DECODE_PATHS
                                                  for what in ("us", "pct_copy_bw")}}]
    table = prefill.markdown([row], decode, 4000.0)
    assert "| 4 x 4096 | 256 (16/4) | yes |" in table
    header = next(line for line in table.splitlines() if line.startswith("| group |"))
    assert header.count("% copy BW") == len(prefill.DECODE_PATHS)


def test_decode_kv_dtype_refuses_unknown(capsys):
    from attnforge.benchmarks import decode

    assert decode.parse_args(["--kv-dtype", "bf16", "e4m3"]).kv_dtype == ["bf16", "e4m3"]
    with pytest.raises(SystemExit):
        decode.parse_args(["--kv-dtype", "fp4"])
    err = capsys.readouterr().err
    assert "--kv-dtype" in err and "fp4" in err


def test_decode_pdl_options():
    from attnforge.benchmarks import decode

    args = decode.parse_args([])
    assert not args.no_pdl and args.pdl_runs == 32
    args = decode.parse_args(["--no-pdl", "--pdl-runs", "8"])
    assert args.no_pdl and args.pdl_runs == 8
    assert decode.config(args)["pdl"] is None
    assert decode.config(decode.parse_args([]))["pdl"]["runs"] == 32


def test_decode_pdl_markdown_has_a_row_per_case():
    from attnforge.benchmarks import _pdl

    rows = [_pdl.PdlRow("decode", "cuda_cores", 64, 1024, 32, 20.0, 16.0, 1.25),
            _pdl.PdlRow("prefill", "fa3 paged", 16, 1024, 32, 400.0, 390.0, 400.0 / 390.0, "a note")]
    lines = _pdl.markdown(rows).splitlines()
    assert lines[2] == "| decode | cuda_cores | 64 | 1024 | 20.00 | 16.00 | 1.250 |  |"
    assert lines[3].endswith("| 1.026 | a note |")
