"""bench decode's tensor-core rows without a device: the default run has them, and the table puts
the copy-bandwidth-bound time beside ours and FlashInfer's."""

from __future__ import annotations

from attnforge.benchmarks import decode


def test_batch1_16k_tensor_core_row_is_in_the_default_run():
    assert (1, 16384) in decode.TENSOR_CORE_SHAPES
    assert not decode.parse_args([]).no_tensor_cores and decode.parse_args(["--no-tensor-cores"]).no_tensor_cores


def test_tensor_core_table_shows_the_bound_and_the_peer():
    rows = [decode.TensorCoreRow(1, 16384, us=30.0, bound_us=27.0, flashinfer_us=27.6),
            decode.TensorCoreRow(1, 16384, us=30.0, bound_us=27.0, flashinfer_us=None, notes="FlashInfer not importable")]
    lines = decode.tensor_core_markdown(rows)
    assert lines[-2] == "| 1 | 16384 | 30.0 | 27.6 | 0.920 | 27.0 | 90.0 |  |"
    assert lines[-1] == "| 1 | 16384 | 30.0 | n/a | n/a | 27.0 | 90.0 | FlashInfer not importable |"
