"""bench report without a GPU: hand-made records render into the family tables with their peers and
ratios, the same text every time; records made by the benchmarks' own code render too (CPU)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from attnforge.benchmarks import _pdl, _record, build, decode, fp8, prefill, report

SHA = "0123456789abcdef0123456789abcdef01234567"


def header(name: str) -> dict:
    return dict(schema=_record.SCHEMA, benchmark=name, date="2026-12-03T10:11:12Z", gpu="NVIDIA H200", commit=SHA,
                attnforge_version="0.1.0", torch="2.11.0+cu130", cuda="13.0", argv=[], units=_record.UNITS)


HEADS = {"128": dict(num_qo_heads=32, num_kv_heads=8), "256": dict(num_qo_heads=16, num_kv_heads=4)}
DECODE = {
    **header("decode"),
    "config": dict(dtype="bf16", num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, layout="NHD",
                   bytes="q + K + V + o", copy="4 GiB D2D copy, read + write",
                   pdl=dict(runs=32, decode_batch=64, decode_kv_lens=[1024, 4096], prefill_batch=16, prefill_len=1024,
                            prefill_causal=True, method="one CUDA graph of 32 back-to-back run() calls")),
    "copy_bandwidth_gbps": 4273.4,
    "tables": {
        "decode": [
            dict(kv_dtype="bf16", batch=64, kv_len=4096, us=250.0, gbps=4264.2, pct_copy_bw=99.7, cudnn_us=240.0,
                 flash_us=400.0, speedup_vs_bf16_kv=None, notes="", cudnn_max_abs_vs_ours=3.9e-3,
                 flash_max_abs_vs_ours=7.8e-3),
            dict(kv_dtype="bf16", batch=1, kv_len=16384, us=50.0, gbps=1300.0, pct_copy_bw=30.4, cudnn_us=None,
                 flash_us=60.0, speedup_vs_bf16_kv=None, notes="cudnn n/a: no kernel", cudnn_max_abs_vs_ours=None,
                 flash_max_abs_vs_ours=1e-3),
        ],
        "plan": [dict(batch=1, kv_len=4096, calls=200, us=18.2), dict(batch=256, kv_len=4096, calls=200, us=30.8)],
        "check": [dict(kv_dtype="bf16", batch=1, kv_len=16384, max_abs=2e-3, rel_l2=1.5e-3)],
        "overhead": [dict(library="attnforge", path="CUDA cores", batch=1, kv_len=1024, eager_us=21.5, graph_us=9.0,
                          overhead_us=12.5, host_us=20.1),
                     dict(library="flashinfer", path="tensor cores", batch=1, kv_len=1024, eager_us=30.0,
                          graph_us=10.0, overhead_us=20.0, host_us=28.7)],
        "pdl": [dict(kind="decode", path="cuda_cores", batch=64, kv_len=1024, runs=32, off_us=20.0, on_us=16.0,
                     speedup=1.25, notes=""),
                dict(kind="prefill", path="fa3 paged", batch=16, kv_len=1024, runs=32, off_us=400.0, on_us=390.0,
                     speedup=400.0 / 390.0, notes="outputs with and without PDL differ")],
    },
}
PREFILL_ROW = dict(batch=4, length=4096, head_dim=128, causal=False, paged_tflops=320.0, ragged_tflops=340.0,
                   fa3_paged_tflops=630.0, fa3_ragged_tflops=600.0, cudnn_tflops=500.0, flash_tflops=340.0, notes="",
                   cudnn_rel_l2_vs_ours=2e-3, flash_rel_l2_vs_ours=3e-3)
PREFILL = {
    **header("prefill"),
    "config": dict(dtype="bf16", heads_by_head_dim=HEADS, page_size=16, backends=["fa2", "fa3"],
                   flops="4 * B * L^2 * Hq * D, halved for causal", check_shape="3 x 300",
                   decode=dict(batch=64, kv_len=4096, num_kv_heads=8, head_dim=128, groups=[1, 8],
                               paths=["cuda_cores", "tensor_cores_fa2", "tensor_cores_fa3"])),
    "copy_bandwidth_gbps": 4300.0,
    "tables": {
        "prefill": [PREFILL_ROW, {**PREFILL_ROW, "causal": True, "cudnn_tflops": None, "notes": "cudnn n/a: refused"}],
        "tensor_core_decode": [
            dict(group=g, max_abs_diff=1e-3, **{f"{p}_{u}": v for p in ("cuda_cores", "tensor_cores_fa2",
                                                                         "tensor_cores_fa3")
                                                 for u, v in (("us", 250.0 * g), ("pct_copy_bw", 99.0 / g))})
            for g in (1, 8)],
        "check": [dict(backend=b, paged=p, causal=False, max_abs=m, rel_l2=1e-3)
                  for b, m in (("fa2", 4e-3), ("fa3", 8e-3)) for p in (False, True)],
    },
}
FP8 = {
    **header("fp8"),
    "config": dict(scales=dict(q=0.5, k=0.75, v=1.0), heads_by_head_dim={"256": HEADS["256"]},
                   flops="4 * B * L^2 * Hq * D, halved for causal, for every dtype",
                   decode=dict(batch=64, kv_len=4096, num_kv_heads=8, head_dim=128, page_size=16, groups=[1])),
    "copy_bandwidth_gbps": 4290.0,
    "tables": {
        "fa3_prefill": [dict(batch=4, length=4096, head_dim=256, causal=True, fp8_paged_tflops=900.0,
                             fp8_ragged_tflops=1000.0, bf16_ragged_tflops=625.0, cudnn_tflops=500.0, rel_l2=2.6e-2,
                             max_abs=0.1, notes="")],
        "fa2_fp8_kv_prefill": [dict(batch=4, length=4096, head_dim=256, causal=False, fp8_kv_paged_tflops=300.0,
                                    fp8_kv_ragged_tflops=320.0, bf16_ragged_tflops=400.0, rel_l2=2.5e-3,
                                    max_abs=1e-2)],
        "decode": [dict(path="tensor cores (fa2)", group=1, bf16_us=270.0, fp8_us=150.0, bf16_pct_copy_bw=97.0,
                        fp8_pct_copy_bw=88.0, rel_l2=1e-2, max_abs=3e-3)],
    },
}
MANIFEST = dict(name="default", archs=["sm_90a"], parallel=4,
                command="attnforge build --arch 90a -j 4 --cache-dir <empty dir>")
BUILD = {
    **header("build"),
    "config": dict(what="render + nvcc + link", cpu_count=16, nvcc="release 13.0", flashinfer_what="build_jit_specs",
                   flashinfer_version="0.7.4", flashinfer_note="", manifest=MANIFEST),
    "tables": {
        "build": [dict(module="decode fa2 bf16 hd128", family="decode-fa2", arch="sm_90a", head_dim=128,
                       cold_build_s=4.44, flashinfer_s=14.9, notes=""),
                  dict(module="prefill fa3 bf16 hd128", family="prefill-fa3", arch="sm_90a", head_dim=128,
                       cold_build_s=28.0, flashinfer_s=None, notes="FlashInfer's build failed (exit 1)"),
                  dict(module="prefill fa3 e4m3 q/kv, bf16 o hd128", family="prefill-fa3-e4m3", arch="sm_90a",
                       head_dim=128, cold_build_s=30.0, flashinfer_s=None, notes="")],
        "manifest": [dict(module="decode_fa2_qbf16_hd128_abc", status="built", seconds=6.31, size_mib=1.5),
                     dict(module="prefill_fa3_qbf16_hd128_def", status="failed", seconds=None, size_mib=None)],
        "manifest_total": [dict(modules=2, built=1, cached=0, failed=1, build_s=80.0, wall_s=81.5, exit_code=1,
                                cpu_s=1043.2, notes="")],
    },
}
RECORDS = {"build": BUILD, "decode": DECODE, "prefill": PREFILL, "fp8": FP8}


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, record in RECORDS.items():
        paths[name] = tmp_path / f"bench-{name}.json"
        paths[name].write_text(json.dumps(record))
    return paths


def rendered(paths, capsys) -> str:
    assert report.main([str(p) for p in paths]) == 0
    return capsys.readouterr().out


def section(text: str, title: str) -> list[str]:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0].splitlines()


def prose(lines: list[str]) -> str:
    """The text with its line breaks and runs of spaces as single spaces (prose is wrapped)."""
    return " ".join(" ".join(lines).split())


def row(lines: list[str], start: str) -> list[str]:
    line = next(line for line in lines if line.startswith(start))
    return [cell.strip() for cell in line.strip("|").split("|")]


def columns(lines: list[str], first: str) -> list[str]:
    return row(lines, f"| {first} |")


def test_every_family_has_its_run_line_peers_and_ratios(files, capsys):
    text = rendered(files.values(), capsys)
    assert text.startswith("# Benchmarks\n") and "do not edit by hand" in prose([text])
    assert "`bench-build.json`, `bench-decode.json`, `bench-prefill.json`, `bench-fp8.json`" in prose([text])
    assert max(len(line) for line in text.splitlines() if not line.startswith("|")) <= report.WIDTH
    titles = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert titles == ["Decode", "FA2 prefill", "FA3 prefill", "FP8", "Build times"]
    for title in titles:
        assert prose(section(text, title)).startswith("Run `bench-")
        assert "2026-12-03 10:11 UTC, NVIDIA H200, commit `0123456789`, attnforge 0.1.0" in prose(section(text, title))

    lines = section(text, "Decode")
    head = columns(lines, "kv dtype")
    assert head[-2:] == ["speed-up vs cuDNN", "speed-up vs FLASH"] and "speed-up vs bf16 KV" not in head
    assert row(lines, "| bf16 | 64 |") == ["bf16", "64", "4096", "250.0", "4264", "99.7", "240.0", "400.0",
                                          "0.960", "1.600"]
    assert row(lines, "| bf16 | 1 |")[6:] == ["n/a", "60.0", "n/a", "1.200"]
    assert "- bf16 1 x 16384: cudnn n/a: no kernel" in lines
    assert "plan() host time, median of 200 calls at kv len 4096: batch 1 18.2 µs, batch 256 30.8 µs." in prose(lines)
    assert "run() host overhead, batch 1 x kv 1024: back-to-back eager calls" in prose(lines)
    assert row(lines, "| attnforge | CUDA cores |") == ["attnforge", "CUDA cores", "21.5", "9.0", "12.5", "20.1"]
    assert row(lines, "| flashinfer | tensor cores |") == ["flashinfer", "tensor cores", "30.0", "10.0", "20.0", "28.7"]
    assert "copy bandwidth 4273 GB/s" in prose(lines) and "within 7.8e-03 max abs of ours" in prose(lines)
    assert len(row(lines, "| GQA group |")) == 1 + 2 * 3 + 1
    assert row(lines, "| 8 |")[:3] == ["8", "2000.0", "12.4"]
    assert columns(lines, "kind") == ["kind", "path", "batch", "kv len", "no PDL (µs/run)", "PDL (µs/run)", "speed-up"]
    assert row(lines, "| decode | cuda cores |") == ["decode", "cuda cores", "64", "1024", "20.00", "16.00", "1.250"]
    assert row(lines, "| prefill | fa3 paged |")[-1] == "1.026"
    assert "- prefill fa3 paged 1024: outputs with and without PDL differ" in lines
    assert "Programmatic dependent launch (`enable_pdl`): one CUDA graph of 32 back-to-back run() calls." in prose(lines)

    lines = section(text, "FA2 prefill")
    assert columns(lines, "batch x len")[3:] == ["paged TFLOP/s", "ragged TFLOP/s", "SDPA FLASH TFLOP/s",
                                                 "SDPA cuDNN TFLOP/s", "ragged / FLASH", "ragged / cuDNN",
                                                 "paged / ragged"]
    assert row(lines, "| 4 x 4096 | 128 (32/8) | no |")[3:] == ["320.0", "340.0", "340.0", "500.0", "1.00", "0.68",
                                                               "0.94"]
    assert row(lines, "| 4 x 4096 | 128 (32/8) | yes |")[6:8] == ["n/a", "1.00"]
    assert "max abs 4.0e-03" in prose(lines) and "- 4 x 4096 hd 128 causal: cudnn n/a: refused" in lines

    lines = section(text, "FA3 prefill")
    assert columns(lines, "batch x len")[5:] == ["SDPA cuDNN TFLOP/s", "SDPA FLASH TFLOP/s", "ragged / cuDNN",
                                                 "ragged / FLASH", "paged / ragged"]
    assert row(lines, "| 4 x 4096 | 128 (32/8) | no |")[3:] == ["630.0", "600.0", "500.0", "340.0", "1.20", "1.76",
                                                               "1.05"]
    assert "max abs 8.0e-03" in prose(lines)

    lines = section(text, "FP8")
    assert row(lines, "| 4 x 4096 | 256 (16/4) | yes |")[3:] == ["900.0", "1000.0", "625.0", "500.0", "1.60", "2.00",
                                                                "n/a", "2.60e-02"]
    assert row(lines, "| 4 x 4096 | 256 (16/4) | no |")[3:] == ["300.0", "320.0", "400.0", "0.80", "2.50e-03"]
    assert row(lines, "| tensor cores (fa2) |") == ["tensor cores (fa2)", "1", "270.0", "97.0", "150.0", "88.0",
                                                   "1.80", "1.00e-02"]

    lines = section(text, "Build times")
    assert columns(lines, "module")[2:] == ["ours (s), incl. process start", "FlashInfer (s), incl. process start",
                                           "speed-up vs FlashInfer"]
    assert row(lines, "| decode fa2") == ["decode fa2 bf16 hd128", "sm_90a", "4.4", "14.9", "3.36"]
    assert row(lines, "| prefill fa3 bf16") == ["prefill fa3 bf16 hd128", "sm_90a", "28.0", "n/a", "n/a"]
    assert "- prefill fa3 bf16 hd128 sm_90a: FlashInfer's build failed (exit 1)" in lines
    assert ("`attnforge build --arch 90a -j 4 --cache-dir <empty dir>` (default manifest, sm_90a; 4 module builds "
            "at once on 16 CPUs): 2 modules (1 built, 1 failed) in 81.5 s of wall time") in prose(lines)
    assert ("The compilers used 1043.2 CPU seconds, 80% of 16 CPUs over the wall time: the build cannot take less "
            "than 65.2 s on this host without compiling less.") in prose(lines)
    assert row(lines, "| decode_fa2_") == ["decode_fa2_qbf16_hd128_abc", "6.3", "1.5"]
    assert row(lines, "| prefill_fa3_") == ["prefill_fa3_qbf16_hd128_def", "failed", "n/a"]


def test_every_table_row_has_its_header_s_cells(files, capsys):
    text = rendered(files.values(), capsys)
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    assert len(blocks) == 11
    for block in blocks:
        assert len({line.count("|") for line in block}) == 1, block[0]
        assert set(block[1].strip("|").replace(" ", "").split("|")) <= {"---", "---:"}


def test_the_output_depends_on_the_records_only(files, tmp_path, capsys):
    """Same text for any order of the files, on every call; written atomically with --output."""
    first = rendered(files.values(), capsys)
    assert rendered(reversed(list(files.values())), capsys) == first
    out = tmp_path / "benchmarks.md"
    assert report.main([*map(str, files.values()), "--output", str(out)]) == 0
    assert out.read_text() == first and capsys.readouterr().out == ""
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_missing_family_is_left_out_and_named_on_stderr(files, capsys):
    assert report.main([str(files["decode"])]) == 0
    captured = capsys.readouterr()
    assert "## Decode" in captured.out and "## FA2 prefill" not in captured.out and "## FP8" not in captured.out
    assert "no prefill record given" in captured.err and "no decode record" not in captured.err
    assert "Run `bench-decode.json`" in captured.out and "GQA group" not in captured.out


def test_fa3_section_is_left_out_off_sm90(tmp_path, capsys):
    record = json.loads(json.dumps(PREFILL))
    record["config"]["backends"] = ["fa2"]
    for r in record["tables"]["prefill"]:
        r["fa3_paged_tflops"] = r["fa3_ragged_tflops"] = None
    path = tmp_path / "p.json"
    path.write_text(json.dumps(record))
    text = rendered([path], capsys)
    assert "## FA2 prefill" in text and "## FA3 prefill" not in text


@pytest.mark.parametrize("bad, message", [
    ({"benchmark": "decode", "schema": 99, "tables": {}}, "not a schema-1 record"),
    ({"benchmark": "sdpa", "schema": 1, "tables": {}}, "not a schema-1 record"),
    ([1, 2], "not a schema-1 record"),
])
def test_a_file_that_is_not_a_record_is_refused(bad, message, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_two_records_of_one_benchmark_are_refused(files, capsys):
    assert report.main([str(files["fp8"]), str(files["fp8"])]) == 2
    assert "a second fp8 record" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# records made by the benchmarks' own code (rows from their dataclasses, config from their defaults)


def test_records_written_by_the_benchmarks_render(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_record, "header", lambda name, argv=None: header(name))
    monkeypatch.setattr(build, "nvcc_version", lambda: "Cuda compilation tools, release 13.0, V13.0.88")
    monkeypatch.setattr(prefill, "BACKENDS", ("fa2", "fa3"))
    drow = decode.Row("bf16", 64, 4096, 250.0, 4264.0, 99.7, 240.0, None, 250.0 / 240.0)
    prow = prefill.Row(4, 4096, 128, True, 10.0, 8.0, 300.0, 320.0, 550.0, 600.0, 560.0, 330.0)
    tc = {"group": 4, "max_abs_diff": 0.0, **{f"{key}_{what}": 1.0 for key, _, _ in prefill.DECODE_PATHS
                                              for what in ("us", "pct_copy_bw")}}
    bargs = build.parse_args([])
    records = {
        "decode": (decode.config(decode.parse_args([])), dict(
            decode=[asdict(drow)], plan=[dict(batch=1, kv_len=decode.PLAN_KV_LEN, calls=decode.PLAN_CALLS, us=20.0)],
            check=[dict(kv_dtype="bf16", batch=1, kv_len=1024, max_abs=1e-3, rel_l2=1e-3)],
            pdl=[asdict(_pdl.PdlRow("decode", "tensor_cores_fa3", 64, 4096, 32, 30.0, 24.0, 1.25))])),
        "prefill": (prefill.config(prefill.parse_args([])), dict(
            prefill=[asdict(prow)], tensor_core_decode=[tc],
            check=[dict(backend="fa3", paged=True, causal=True, max_abs=1e-3, rel_l2=1e-3)])),
        "fp8": (fp8.config(fp8.parse_args([])), dict(
            fa3_prefill=[asdict(fp8.PrefillRow(4, 4096, 256, False, 900.0, 1000.0, 625.0, None, 2e-2, 0.1))],
            fa2_fp8_kv_prefill=[asdict(fp8.Fp8KvPrefillRow(4, 4096, 128, True, 310.0, 320.0, 340.0, 2e-3, 1e-2))],
            decode=[asdict(fp8.DecodeRow("CUDA cores (fa2)", 1, 300.0, 150.0, 40.0, 41.0, 1e-2, 3e-3))])),
        "build": (build.config(bargs, None, "flashinfer is not importable (No module named 'flashinfer')"),
                  dict(build=[{**r, "cold_build_s": 4.0} for r in build.cold_rows(bargs)[0]])),
    }
    paths = []
    for name, (config, tables) in records.items():
        paths.append(tmp_path / f"bench-{name}.json")
        _record.write(str(paths[-1]), name, [], config, tables, copy_bandwidth_gbps=4000.0)
    text = rendered(paths, capsys)
    for cells in ("| bf16 | 64 | 4096 | 250.0 |", "| 4 x 4096 | 128 (32/8) | yes | 300.0 | 320.0 |",
                  "| 4 x 4096 | 128 (32/8) | yes | 550.0 | 600.0 |",
                  "| 4 x 4096 | 256 (16/4) | no | 900.0 | 1000.0 | 625.0 | n/a | 1.60 | n/a |",
                  "| 4 x 4096 | 128 (32/8) | yes | 310.0 |", "| CUDA cores (fa2) | 1 | 300.0 |",
                  "| decode fa2 bf16 hd128 | sm_90a | 4.0 | n/a | n/a |",
                  "| prefill fa3 e4m3 q/kv, bf16 o hd128 | sm_90a | 4.0 | n/a | n/a |", "| 4 | 1.0 | 1.0 |",
                  "| decode | tensor cores fa3 | 64 | 4096 | 30.00 | 24.00 | 1.250 |"):
        assert cells in text
    assert "FlashInfer: flashinfer is not importable (No module named 'flashinfer')." in prose([text])
    assert "--cache-dir <empty dir>` did not finish" in prose([text])


def test_a_record_missing_a_field_is_refused_in_one_line(tmp_path, capsys):
    record = json.loads(json.dumps(DECODE))
    del record["copy_bandwidth_gbps"]
    path = tmp_path / "bench-decode.json"
    path.write_text(json.dumps(record))
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "copy_bandwidth_gbps" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------
# decode by head dim, graph timing and sinks: records with them, and records from before them


def graph_decode() -> dict:
    """DECODE as bench decode writes it now: graph-timed, two head dims, a skipped row, the sinks case."""
    record = json.loads(json.dumps(DECODE))
    args = decode.parse_args(["--head-dims", "128", "512"])
    record["config"].update(head_dims=args.head_dims, graph_runs=args.graph_runs, timer=decode.timer(args),
                            sinks=decode.config(args)["sinks"])
    rows = record["tables"]["decode"]
    rows[0]["head_dim"] = rows[1]["head_dim"] = 128
    rows.append({**rows[0], "head_dim": 512, "us": 1000.0, "gbps": 4200.0, "pct_copy_bw": 98.3})
    rows.append({**rows[0], **{k: None for k in ("us", "gbps", "pct_copy_bw", "cudnn_us", "flash_us")},
                 "head_dim": 512, "batch": 256, "kv_len": 16384, "notes": "skipped: needs ~162 GiB"})
    record["tables"]["check"][0]["head_dim"] = 128
    record["tables"]["sinks"] = [asdict(decode.SinksRow("CUDA cores", 64, 4096, 250.0, 255.0, 250.0 / 255.0)),
                                 asdict(decode.SinksRow("tensor cores", 64, 4096, None, None, None, "n/a: ValueError"))]
    return record


def test_decode_rows_by_head_dim_say_how_they_were_timed_and_what_sinks_cost(tmp_path, capsys):
    path = tmp_path / "bench-decode.json"
    path.write_text(json.dumps(graph_decode()))
    lines = section(rendered([path], capsys), "Decode")
    text = prose(lines)
    assert columns(lines, "kv dtype")[:3] == ["kv dtype", "head dim", "batch"]
    assert row(lines, "| bf16 | 512 | 64 |")[:7] == ["bf16", "512", "64", "4096", "1000.0", "4200", "98.3"]
    assert row(lines, "| bf16 | 512 | 256 |")[4:] == ["n/a"] * 7
    assert "- bf16 256 x 16384 hd 512: skipped: needs ~162 GiB" in lines
    assert "32 q / 8 kv heads, hd by row," in text and "bf16 KV 1 x 16384 hd 128: max abs" in text
    assert "Timing: ours and FlashInfer (CUDA and tensor cores): one CUDA graph of 10 back-to-back run() calls" in text
    assert "SDPA (one kernel call): CUDA events around each eager call, the median." in text
    assert "Attention sinks (gpt-oss; run(..., sinks=s), s fp32 [num_qo_heads], random), batch 64 x kv 4096" in text
    assert columns(lines, "decode path") == ["decode path", "without sinks (µs)", "with sinks (µs)", "without / with"]
    assert row(lines, "| CUDA cores | 250.0 |") == ["CUDA cores", "250.0", "255.0", "0.980"]
    assert row(lines, "| tensor cores | n/a |") == ["tensor cores", "n/a", "n/a", "n/a"]
    assert "- sinks tensor cores: n/a: ValueError" in lines


def test_decode_of_one_head_dim_names_it_and_has_no_head_dim_column(tmp_path, capsys):
    record = graph_decode()
    record["tables"]["decode"] = [{**r, "head_dim": 256} for r in record["tables"]["decode"][:2]]
    path = tmp_path / "bench-decode.json"
    path.write_text(json.dumps(record))
    lines = section(rendered([path], capsys), "Decode")
    assert "32 q / 8 kv heads, hd 256," in prose(lines) and "head dim" not in columns(lines, "kv dtype")
    assert row(lines, "| bf16 | 64 |")[:3] == ["bf16", "64", "4096"]


def test_decode_records_from_before_graph_timing_render_as_before(files, capsys):
    lines = section(rendered([files["decode"]], capsys), "Decode")
    assert "Timing:" not in prose(lines) and "Attention sinks" not in prose(lines)
    assert "hd 128, page 16, NHD" in prose(lines) and columns(lines, "kv dtype")[:2] == ["kv dtype", "batch"]


# ---------------------------------------------------------------------------------------
# FlashInfer columns: rendered beside ours where a record has them (records from before have none)

PEER = dict(version="0.7.4", note="", method="same process, same tensors, same plan()/run() arguments and timer")


def with_peer() -> dict:
    """RECORDS with FlashInfer's fields in every table that has them, one refused call per table."""
    records = json.loads(json.dumps(RECORDS))
    for name in ("decode", "prefill", "fp8"):
        records[name]["config"]["flashinfer"] = PEER
    d = records["decode"]["tables"]["decode"]
    d[0].update(tc_us=240.0, tc_pct_copy_bw=98.0, flashinfer_us=300.0, flashinfer_tc_us=200.0,
                flashinfer_max_abs_vs_ours=4e-3)
    d[1].update(tc_us=50.0, tc_pct_copy_bw=30.4, flashinfer_us=None, flashinfer_tc_us=25.0, flashinfer_max_abs_vs_ours=None,
                notes="FlashInfer CUDA-core decode, bf16 KV n/a: RuntimeError: unsupported")
    for r in records["prefill"]["tables"]["prefill"]:
        r.update(flashinfer_paged_tflops=400.0, flashinfer_ragged_tflops=340.0, flashinfer_fa3_paged_tflops=None,
                 flashinfer_fa3_ragged_tflops=500.0, flashinfer_rel_l2_vs_ours=2e-3)
    for r in records["prefill"]["tables"]["tensor_core_decode"]:
        r.update(flashinfer_cuda_cores_us=500.0, flashinfer_tensor_cores_fa2_us=250.0,
                 flashinfer_tensor_cores_fa3_us=None, notes="FlashInfer tensor cores fa3 decode n/a: ValueError: no")
    f = records["fp8"]["tables"]
    f["fa3_prefill"][0].update(flashinfer_fp8_paged_tflops=720.0, flashinfer_fp8_ragged_tflops=800.0,
                               flashinfer_rel_l2_vs_bf16=2.5e-2)
    f["fa2_fp8_kv_prefill"][0].update(flashinfer_fp8_kv_paged_tflops=None, flashinfer_fp8_kv_ragged_tflops=256.0,
                                      notes="FlashInfer fa2 e4m3 KV paged prefill hd 256 n/a: RuntimeError: x")
    f["decode"][0].update(flashinfer_bf16_us=256.0, flashinfer_fp8_us=300.0, notes="")
    return records


def test_flashinfer_columns_and_ratios_render_beside_ours(tmp_path, capsys):
    paths = []
    for name, record in with_peer().items():
        paths.append(tmp_path / f"bench-{name}.json")
        paths[-1].write_text(json.dumps(record))
    text = rendered(paths, capsys)

    lines = section(text, "Decode")
    assert columns(lines, "kv dtype")[-4:] == ["FlashInfer CUDA cores (µs)", "FlashInfer tensor cores (µs)",
                                               "CUDA cores: ours / FlashInfer", "tensor cores: ours / FlashInfer"]
    # the tensor-core ratio is ours on tensor cores against FlashInfer's
    assert row(lines, "| bf16 | 64 |")[-4:] == ["300.0", "200.0", "1.20", "0.83"]
    assert row(lines, "| bf16 | 64 |")[6:8] == ["240.0", "98.0"]
    assert row(lines, "| bf16 | 1 |")[-4:] == ["n/a", "25.0", "n/a", "0.50"]
    assert "- bf16 1 x 16384: FlashInfer CUDA-core decode, bf16 KV n/a: RuntimeError: unsupported" in lines
    assert "FlashInfer 0.7.4: same process" in prose(lines) and "(its outputs within max abs 4.0e-03)" in prose(lines)
    assert row(lines, "| 8 |")[-6:] == ["500.0", "250.0", "n/a", "0.25", "0.12", "n/a"]
    assert "- GQA group 1: FlashInfer tensor cores fa3 decode n/a: ValueError: no" in lines

    lines = section(text, "FA2 prefill")
    assert columns(lines, "batch x len")[-4:] == ["FlashInfer paged (TFLOP/s)", "FlashInfer ragged (TFLOP/s)",
                                                  "paged: ours / FlashInfer", "ragged: ours / FlashInfer"]
    assert row(lines, "| 4 x 4096 | 128 (32/8) | no |")[-4:] == ["400.0", "340.0", "0.80", "1.00"]
    lines = section(text, "FA3 prefill")
    assert row(lines, "| 4 x 4096 | 128 (32/8) | no |")[-4:] == ["n/a", "500.0", "n/a", "1.20"]

    lines = section(text, "FP8")
    assert row(lines, "| 4 x 4096 | 256 (16/4) | yes |")[-4:] == ["720.0", "800.0", "1.25", "1.25"]
    assert row(lines, "| 4 x 4096 | 256 (16/4) | no |")[-4:] == ["n/a", "256.0", "n/a", "1.25"]
    assert "- 4 x 4096 hd 256: FlashInfer fa2 e4m3 KV paged prefill hd 256 n/a: RuntimeError: x" in lines
    assert row(lines, "| tensor cores (fa2) |")[-4:] == ["256.0", "300.0", "0.95", "2.00"]


def test_fp8_rows_stand_beside_the_next_larger_head_dim_of_their_shape(tmp_path, capsys):
    """Issue 38's fp8 head dims (64, 96, 192) against the next larger one run: the paged FLOP rates' ratio,
    per shape and causal flag; the largest dim has none."""
    record = json.loads(json.dumps(FP8))
    record["config"]["heads_by_head_dim"].update({d: HEADS["128"] for d in ("96", "128")})
    base = record["tables"]["fa3_prefill"][0]
    record["tables"]["fa3_prefill"] = [{**base, "head_dim": d, "causal": c, "fp8_paged_tflops": t}
                                       for d, c, t in ((96, True, 600.0), (128, True, 800.0), (256, True, 1000.0),
                                                       (96, False, 700.0))]
    path = tmp_path / "bench-fp8.json"
    path.write_text(json.dumps(record))
    lines = section(rendered([path], capsys), "FP8")
    ratio = columns(lines, "batch x len").index("fp8 vs next larger")
    assert [row(lines, f"| 4 x 4096 | {d} |")[ratio] for d in ("96 (32/8) | yes", "128 (32/8) | yes", "256 (16/4) | yes",
                                                                 "96 (32/8) | no")] == ["0.75", "0.80", "n/a", "n/a"]
    assert "fp8 vs next larger: the fp8 paged FLOP rate over that of the next larger head dim" in prose(lines)


def test_a_record_whose_peer_did_not_run_says_why(tmp_path, capsys):
    record = json.loads(json.dumps(PREFILL))
    record["config"]["flashinfer"] = dict(version=None, note="not run (--no-flashinfer)", method="")
    for r in record["tables"]["prefill"]:
        r.update(flashinfer_paged_tflops=None, flashinfer_ragged_tflops=None)
    path = tmp_path / "bench-prefill.json"
    path.write_text(json.dumps(record))
    lines = section(rendered([path], capsys), "FA2 prefill")
    assert "FlashInfer: not run (--no-flashinfer)." in prose(lines)
    assert row(lines, "| 4 x 4096 | 128 (32/8) | no |")[-4:] == ["n/a"] * 4


def test_records_from_before_the_peer_render_without_its_columns(files, capsys):
    text = rendered(files.values(), capsys)
    for title in ("Decode", "FA2 prefill", "FA3 prefill", "FP8"):
        lines = section(text, title)
        assert not any("FlashInfer" in line for line in lines if line.startswith("| "))
        assert "FlashInfer 0.7.4:" not in prose(lines) and "FlashInfer: " not in prose(lines)
