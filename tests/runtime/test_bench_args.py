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
