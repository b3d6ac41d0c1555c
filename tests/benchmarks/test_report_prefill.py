"""bench report's prefill-by-head-dim and attention-sinks tables without a GPU: hand-made prefill records
render them with their ratios and targets; records without them (one head dim, no sinks) leave them out
(CPU)."""

from __future__ import annotations

import json

import pytest

from attnforge.benchmarks import _record, prefill, report

HEADS = {"128": dict(num_qo_heads=32, num_kv_heads=8), "256": dict(num_qo_heads=16, num_kv_heads=4),
         "512": dict(num_qo_heads=16, num_kv_heads=4)}
FA3_512 = "fa3 n/a: [fa3-head-dim-512] fa3 has no kernel for head dim 512"


def prefill_row(batch, length, dim, causal, fa2, fa3, cudnn, notes=""):
    return dict(batch=batch, length=length, head_dim=dim, causal=causal, paged_tflops=fa2, ragged_tflops=fa2,
                fa3_paged_tflops=fa3, fa3_ragged_tflops=fa3, cudnn_tflops=cudnn, flash_tflops=None, notes=notes)


def record(rows, sinks=None, backends=("fa2", "fa3")) -> dict:
    config = dict(dtype="bf16", heads_by_head_dim=HEADS, page_size=16, backends=list(backends),
                  flops="4 * B * L^2 * Hq * D, halved for causal", check_shape="3 x 300",
                  decode=dict(batch=64, kv_len=4096, num_kv_heads=8, head_dim=128, groups=[1], paths=["cuda_cores"]))
    tables = dict(prefill=rows, tensor_core_decode=[], check=[])
    if sinks is not None:
        config["sinks"] = dict(rounds=3, logits="8 + N(0, 1) per query head, fp32", target=0.97,
                               method="run() and run(sinks=...) on one planned wrapper")
        tables["sinks"] = sinks
    return dict(schema=_record.SCHEMA, benchmark="prefill", date="2026-12-03T10:11:12Z", gpu="NVIDIA H200",
                commit="0123456789abcdef", attnforge_version="0.1.0", torch="2.11.0", cuda="13.0", argv=[],
                units=_record.UNITS, config=config, copy_bandwidth_gbps=4300.0, tables=tables)


DIM_ROWS = [
    prefill_row(4, 4096, 128, False, 300.0, 600.0, 500.0),
    prefill_row(4, 4096, 256, False, 320.0, 650.0, 550.0),
    prefill_row(4, 4096, 512, False, 280.0, None, None, FA3_512 + "; cudnn n/a: No available kernel."),
    prefill_row(4, 4096, 128, True, 250.0, 500.0, None, "cudnn n/a: refused"),
    prefill_row(4, 4096, 256, True, 200.0, 520.0, 400.0),
    prefill_row(16, 1024, 128, False, 290.0, 580.0, 480.0),  # one head dim at this shape: no table
]
SINKS = [prefill.sinks_row("fa2", False, 97.0, 100.0, 0.25), prefill.sinks_row("fa3", True, 50.0, 50.0, 0.0)]


def rendered(tmp_path, doc, capsys) -> str:
    path = tmp_path / "bench-prefill.json"
    path.write_text(json.dumps(doc))
    assert report.main([str(path)]) == 0
    return capsys.readouterr().out


def section(text: str, title: str) -> list[str]:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0].splitlines()


def cells(lines: list[str], start: str) -> list[str]:
    line = next(line for line in lines if line.startswith(start))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_head_dim_table_puts_each_dim_beside_cudnn_and_the_next_larger_dim(tmp_path, capsys):
    lines = section(rendered(tmp_path, record(DIM_ROWS), capsys), "Prefill by head dim")
    prose = " ".join(" ".join(lines).split())
    assert "Prefill at 4 x 4096 by head dim" in prose and "16 x 1024" not in prose
    assert "Targets (issue 38): vs next larger at least 0.9, and ours / cuDNN at least 1 where cuDNN runs" in prose
    assert cells(lines, "| head dim") == ["head dim (q/kv heads)", "causal", "SDPA cuDNN TFLOP/s", "fa2 paged TFLOP/s",
                                          "fa2 / cuDNN", "fa2 vs next larger", "fa3 paged TFLOP/s", "fa3 / cuDNN",
                                          "fa3 vs next larger"]
    body = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [cells([line], "|")[:2] for line in body] == [
        ["128 (32/8)", "no"], ["256 (16/4)", "no"], ["512 (16/4)", "no"], ["128 (32/8)", "yes"], ["256 (16/4)", "yes"]]
    assert cells(body, "| 128 (32/8) | no") == ["128 (32/8)", "no", "500.0", "300.0", "0.60", "0.94", "600.0", "1.20",
                                                "0.92"]
    # fa3 refused at 512: nothing larger for its 256; fa2's 256 over its 512
    assert cells(body, "| 256 (16/4) | no") == ["256 (16/4)", "no", "550.0", "320.0", "0.58", "1.14", "650.0", "1.18",
                                                "n/a"]
    assert cells(body, "| 512 (16/4) | no") == ["512 (16/4)", "no", "n/a", "280.0", "n/a", "n/a", "n/a", "n/a", "n/a"]
    # causal rows compare with causal rows only
    assert cells(body, "| 128 (32/8) | yes") == ["128 (32/8)", "yes", "n/a", "250.0", "n/a", "1.25", "500.0", "n/a",
                                                 "0.96"]
    # the refusal's reason is in the FA2 prefill notes
    assert any(line.startswith("- 4 x 4096 hd 512: " + FA3_512) for line in section(
        rendered(tmp_path, record(DIM_ROWS), capsys), "FA2 prefill"))


def test_next_larger_skips_a_dim_the_backend_did_not_run():
    rows = [prefill_row(1, 8, d, False, 100.0, fa3, None) for d, fa3 in ((64, 90.0), (128, None), (256, 100.0))]
    assert report.next_larger(rows, rows[0], "fa3_paged_tflops") is rows[2]
    assert report.next_larger(rows, rows[0], "paged_tflops") is rows[1]
    assert report.next_larger(rows, rows[2], "paged_tflops") is None


def test_head_dim_table_off_sm90_has_fa2_columns_only(tmp_path, capsys):
    rows = [{**r, "fa3_paged_tflops": None, "fa3_ragged_tflops": None} for r in DIM_ROWS]
    lines = section(rendered(tmp_path, record(rows, backends=("fa2",)), capsys), "Prefill by head dim")
    assert cells(lines, "| head dim")[3:] == ["fa2 paged TFLOP/s", "fa2 / cuDNN", "fa2 vs next larger"]


def test_sinks_table_renders_the_ratio_against_its_target(tmp_path, capsys):
    lines = section(rendered(tmp_path, record(DIM_ROWS, SINKS), capsys), "Attention sinks")
    prose = " ".join(" ".join(lines).split())
    assert "paged prefill at 4 x 4096, hd 128, bf16, run() against run(sinks=s), s = 8 + N(0, 1)" in prose
    assert "target at least 0.97 (sinks cost at most 3%)" in prose
    assert cells(lines, "| backend") == ["backend", "causal", "without sinks (µs)", "with sinks (µs)", "without / with",
                                         "max abs vs no sinks"]
    assert cells(lines, "| fa2 |") == ["fa2", "no", "97.0", "100.0", "0.970", "2.5e-01"]
    assert cells(lines, "| fa3 |") == ["fa3", "yes", "50.0", "50.0", "1.000", "0.0e+00"]
    assert "- fa3 causal: sinks changed no output: not applied?" in lines


@pytest.mark.parametrize("rows", [DIM_ROWS[-1:], [DIM_ROWS[0], {**DIM_ROWS[0], "causal": True}]])
def test_records_with_one_head_dim_a_shape_and_no_sinks_leave_both_tables_out(rows, tmp_path, capsys):
    text = rendered(tmp_path, record(rows), capsys)
    assert "## FA2 prefill" in text and "## Prefill by head dim" not in text and "## Attention sinks" not in text


def test_a_record_written_by_the_benchmark_renders_both_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prefill, "BACKENDS", ("fa2", "fa3"))
    rows = [prefill.Row(4, 4096, d, False, 10.0, 9.0, 300.0 + d, 310.0, fa3, fa3, None, None)
            for d, fa3 in ((128, 600.0), (512, None))]
    from dataclasses import asdict

    doc = record([asdict(r) for r in rows], SINKS)
    doc["config"] = prefill.config(prefill.parse_args(["--head-dims", "128", "512"]))
    text = rendered(tmp_path, doc, capsys)
    assert cells(section(text, "Prefill by head dim"), "| 128 (32/8)")[5] == "0.53"  # 428 / 812
    assert cells(section(text, "Attention sinks"), "| fa2 |")[4] == "0.970"
