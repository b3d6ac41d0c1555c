"""Every benchmark's --out and the JSON record's header, without a GPU (CPU)."""

from __future__ import annotations

import datetime
import json
import re

import pytest
import torch

from attnforge.benchmarks import _record, build, decode, fp8, prefill

BENCHMARKS = {"build": build, "decode": decode, "fp8": fp8, "prefill": prefill}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_takes_out(name):
    module = BENCHMARKS[name]
    assert module.parse_args([]).out is None
    assert module.parse_args(["--out", "results/bench.json"]).out == "results/bench.json"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_out_needs_a_file_name(name, capsys):
    with pytest.raises(SystemExit) as info:
        BENCHMARKS[name].parse_args(["--out"])
    assert info.value.code == 2 and "--out" in capsys.readouterr().err


def test_defaults_unchanged_by_out():
    """--out only adds the record: what is timed stays the defaults'."""
    args = decode.parse_args(["--out", "d.json"])
    assert (args.batch, args.kv_len, args.kv_dtype, args.iters, args.warmup) == ([1, 16, 64, 256],
                                                                                 [1024, 4096, 16384], ["bf16"], 100, 10)
    args = prefill.parse_args(["--out", "p.json"])
    assert (args.shapes, args.head_dims, args.iters, args.warmup) == ([(16, 1024), (4, 4096), (1, 16384)], [128], 30, 5)
    args = build.parse_args(["--out", "b.json"])
    assert (args.head_dim, args.arch) == ([128], ["90a"])


def test_header_names_the_run(monkeypatch):
    monkeypatch.setattr(_record, "_git_commit", lambda: "f" * 40)
    h = _record.header("decode", ["--batch", "64"])
    assert h["schema"] == _record.SCHEMA and h["benchmark"] == "decode" and h["commit"] == "f" * 40
    assert datetime.datetime.strptime(h["date"], "%Y-%m-%dT%H:%M:%SZ")
    assert h["torch"] == torch.__version__ and h["cuda"] == (torch.version.cuda or "none")
    assert h["argv"] == ["--batch", "64"] and h["attnforge_version"] and h["gpu"]
    assert {"us", "tflops", "rel_l2"} <= set(h["units"])


def test_commit_falls_back_to_the_environment_then_unknown(monkeypatch):
    monkeypatch.setattr(_record, "_git_commit", lambda: None)
    monkeypatch.setenv(_record.COMMIT_ENV, " abc123 ")
    assert _record.commit() == "abc123"
    monkeypatch.delenv(_record.COMMIT_ENV)
    assert _record.commit() == "unknown"


def test_commit_of_this_checkout_is_a_sha_or_none():
    sha = _record._git_commit()
    assert sha is None or re.fullmatch(r"[0-9a-f]{40}", sha)


def test_gpu_name_without_cuda_asks_nvidia_smi(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class Done:
        returncode, stdout = 0, "NVIDIA H200\nNVIDIA H200\n"

    monkeypatch.setattr(_record.subprocess, "run", lambda *a, **k: Done())
    assert _record.gpu_name() == "NVIDIA H200"

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(_record.subprocess, "run", missing)
    assert _record.gpu_name() == "none"


def test_write_puts_header_config_and_tables_in_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(_record, "_git_commit", lambda: "unknown-test")
    path = tmp_path / "out" / "bench-build.json"
    _record.write(str(path), "build", [], {"cpu_count": 2}, {"build": [{"cold_build_s": 4.0}]}, extra=1.5)
    record = json.loads(path.read_text())
    assert list(record)[:3] == ["schema", "benchmark", "date"] and list(record)[-1] == "tables"
    assert record["config"] == {"cpu_count": 2} and record["extra"] == 1.5
    assert record["tables"] == {"build": [{"cold_build_s": 4.0}]}
    assert [p.name for p in path.parent.iterdir()] == ["bench-build.json"]  # no temp file left
