"""bench build without a GPU: the families it cold-builds, FlashInfer's peer builds timed through a fake
`flashinfer` package (and recorded as null when it is missing or fails), `attnforge build`'s closing
table read back, the record rewritten after each part; one real run on the tiny manifest (nvcc)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attnforge import build_pool
from attnforge.benchmarks import _cold_build, _manifest_build, build, report
from attnforge.codegen import manifest
from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import check
from attnforge.codegen.spec import Arch, Backend, Kind

SLEEP_S = 0.3

FAKE_MODULES = '''
def _describe(name, *args):
    return [name, *map(str, args)]
def gen_batch_decode_module(*args):
    return _describe("decode", *args)
def gen_batch_prefill_module(*args):
    return _describe("prefill", *args)
def _gen_batch_prefill_primary_module(*args):
    return _describe("prefill_primary", *args)
'''
FAKE_CORE = '''
import json, os, time
def build_jit_specs(specs, verbose=False):
    base = os.environ["FLASHINFER_WORKSPACE_BASE"]
    entry = dict(specs=specs, verbose=verbose, base=base, empty=not os.listdir(base),
                 arch=os.environ.get("FLASHINFER_CUDA_ARCH_LIST"))
    with open(os.environ["FAKE_FLASHINFER_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\\n")
    if specs[0][1] in os.environ.get("FAKE_FLASHINFER_FAIL", "").split():
        raise RuntimeError("ninja: build stopped: subcommand failed.")
    time.sleep(float(os.environ["FAKE_FLASHINFER_SLEEP"]))
'''


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def fake_flashinfer(tmp_path, monkeypatch) -> Path:
    """A `flashinfer` on PYTHONPATH whose generators describe their arguments and whose build_jit_specs
    logs its call and sleeps; returns the log."""
    root = write_package(tmp_path / "site", {
        "flashinfer/__init__.py": '__version__ = "0.7.4+fake"\n', "flashinfer/jit/__init__.py": "",
        "flashinfer/jit/core.py": FAKE_CORE, "flashinfer/jit/attention/__init__.py": "",
        "flashinfer/jit/attention/modules.py": FAKE_MODULES})
    log = tmp_path / "builds.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("FAKE_FLASHINFER_LOG", str(log))
    monkeypatch.setenv("FAKE_FLASHINFER_SLEEP", str(SLEEP_S))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "8.0")  # overridden: the peers pair with sm_90a rows
    return log


def logged(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# ---------------------------------------------------------------------------------------
# what is cold-built


def test_default_families_are_the_four_on_sm90a_and_fa2_only_elsewhere(capsys):
    rows, refused = build.cold_rows(build.parse_args([]))
    assert [r["family"] for r in rows] == list(_cold_build.FAMILY_KEYS) and refused == []
    assert {r["arch"] for r in rows} == {"sm_90a"} and {r["head_dim"] for r in rows} == {128}
    rows, refused = build.cold_rows(build.parse_args(["--arch", "80", "90a"]))
    assert [(r["arch"], r["family"]) for r in rows][:2] == [("sm_80", "decode-fa2"), ("sm_80", "prefill-fa2")]
    assert len(rows) == 6 and len(refused) == 2 and all("fa3-needs-sm90a" in line for line in refused)


def test_every_family_spec_is_valid_and_the_e4m3_one_has_a_bf16_output():
    for row in build.cold_rows(build.parse_args(["--head-dim", "128", "256"]))[0]:
        spec = build.spec_of(row)
        assert check(spec) == [] and spec.archs == (Arch.SM90A,) and spec.head_dim_qk == row["head_dim"]
    e4m3 = _cold_build.family("prefill-fa3-e4m3").spec(128, Arch.SM90A)
    assert (e4m3.kind, e4m3.backend, e4m3.dtype_q, e4m3.dtype_kv, e4m3.dtype_o) == (
        Kind.PREFILL, Backend.FA3, DType.E4M3, DType.E4M3, DType.BF16)


@pytest.mark.parametrize("argv, message", [
    (["--arch", "80", "--families", "prefill-fa3"], "prefill-fa3 --arch 80 --head-dim 128 is refused: [fa3-needs"),
    (["--head-dim", "80", "--families", "prefill-fa3-e4m3"], "[fa3-fp8-head-dims]"),
    (["--head-dim", "100", "--arch", "80"], "no family to cold-build for --arch 80 --head-dim 100"),
    (["--arch", "75"], "argument --arch: unknown arch '75'"),
    (["--head-dim", "x"], "argument --head-dim: expected a positive integer, got 'x'"),
    (["--manifest", "/nonexistent/m.toml"], "--manifest: no such file: /nonexistent/m.toml"),
    (["-j", "0"], "argument -j/--jobs: expected a positive integer, got '0'"),
    (["--keep-cache", __file__], f"--keep-cache: {__file__} exists and is not an empty folder"),
    (["--keep-cache", str(Path(__file__).parent)], "is not an empty folder; a cold build needs an empty cache"),
])
def test_bad_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        build.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# FlashInfer's peer builds


def test_each_flashinfer_build_runs_alone_in_a_fresh_empty_workspace(fake_flashinfer):
    version, note = _cold_build.flashinfer_version()
    assert (version, note) == ("0.7.4+fake", "")
    timings = {which: _cold_build.flashinfer(which, 128) for which in _cold_build.FLASHINFER_MODULES}
    assert all(t.error == "" and SLEEP_S <= t.seconds < 60 for t in timings.values())
    calls = logged(fake_flashinfer)
    assert [c["specs"][0][0] for c in calls] == ["decode", "prefill_primary", "prefill"]
    assert calls[0]["specs"][0] == ["decode", "torch.bfloat16", "torch.bfloat16", "torch.bfloat16", "torch.int32",
                                    "128", "128", "0", "False", "False"]
    assert calls[1]["specs"][0][1:3] == ["fa2", "torch.bfloat16"] and calls[2]["specs"][0][1] == "fa3"
    assert [len(c["specs"][0]) for c in calls] == [10, 13, 13]  # fp16 QK reduction and token-head sf: False
    assert all(c["empty"] and c["arch"] == "9.0a" and c["verbose"] is False for c in calls)
    assert len({c["base"] for c in calls}) == 3 and not any(Path(c["base"]).exists() for c in calls)


def test_peers_pair_with_the_sm90a_rows_and_a_failed_peer_is_a_note(fake_flashinfer, monkeypatch):
    monkeypatch.setenv("FAKE_FLASHINFER_FAIL", "fa3")
    rows, _ = build.cold_rows(build.parse_args(["--arch", "80", "90a"]))
    assert build.run_peers(rows) == ("0.7.4+fake", "")
    paired = {(r["arch"], r["family"]): r for r in rows}
    assert paired["sm_90a", "decode-fa2"]["flashinfer_s"] >= SLEEP_S
    assert paired["sm_90a", "prefill-fa2"]["flashinfer_s"] >= SLEEP_S
    assert paired["sm_90a", "prefill-fa3"]["flashinfer_s"] is None
    assert "FlashInfer's build failed (RuntimeError: ninja: build stopped" in paired["sm_90a", "prefill-fa3"]["notes"]
    assert all(paired[key]["flashinfer_s"] is None for key in paired if key[0] == "sm_80" or "e4m3" in key[1])
    assert len(logged(fake_flashinfer)) == 3


def test_a_missing_flashinfer_gives_null_peers_with_a_note(tmp_path, monkeypatch):
    root = write_package(tmp_path / "site", {"flashinfer/__init__.py": "raise ImportError('trimmed away')\n"})
    monkeypatch.setenv("PYTHONPATH", str(root))
    rows, _ = build.cold_rows(build.parse_args([]))
    version, note = build.run_peers(rows)
    assert version is None and note == "flashinfer is not importable (ImportError: trimmed away)"
    assert all(r["flashinfer_s"] is None and r["notes"] == "" for r in rows)


# ---------------------------------------------------------------------------------------
# attnforge build's closing table


def test_the_closing_table_reads_back(tmp_path):
    specs = manifest.load(manifest.default_manifest_path()).specs[:3]
    libraries = [tmp_path / f"{i}.so" for i in range(2)]
    for library, size in zip(libraries, (3 * 2**20, 2**19)):
        library.write_bytes(b"\0" * size)
    outcomes = [build_pool.Outcome(specs[0], libraries[0], 12.34), build_pool.Outcome(specs[1], libraries[1], None),
                build_pool.Outcome(specs[2], None, 3.0, error="nvcc: error")]
    output = "skipped x (fa3-needs-sm90a)\n" + build_pool.summary_table(outcomes, 20.06) + "\n"
    rows, counts, seconds = _manifest_build.parse_table(output)
    assert rows == [dict(module=specs[0].uri, status="built", seconds=12.3, size_mib=3.0),
                    dict(module=specs[1].uri, status="cached", seconds=None, size_mib=0.5),
                    dict(module=specs[2].uri, status="failed", seconds=None, size_mib=None)]
    assert counts == dict(built=1, cached=1, failed=1) and seconds == 20.1


@pytest.mark.parametrize("output, message", [
    ("attnforge build: error: no such manifest\n", "no closing table"),
    ("module  seconds  size\nsome words here and more\n", "is not 'module seconds size'"),
    ("module  seconds  size\nuri  1.0  2.0 MiB\n", "no closing 'N built"),
])
def test_output_without_a_table_is_refused_by_name(output, message):
    with pytest.raises(_manifest_build.TableError, match=message):
        _manifest_build.parse_table(output)


def test_the_command_is_attnforge_build_of_the_manifest(tmp_path):
    argv = _manifest_build.command(tmp_path / "m.toml", ["80", "90a"], 3, "/tmp/c d")
    assert argv[1:] == ["-m", "attnforge.codegen.cli", "build", "--manifest", str(tmp_path / "m.toml"), "--arch", "80",
                        "--arch", "90a", "-j", "3", "--cache-dir", "/tmp/c d"]
    assert "--manifest" not in _manifest_build.command(None, ["90a"], 1, "c")


# ---------------------------------------------------------------------------------------
# the record, part by part


def test_the_record_is_written_after_each_part(tmp_path, monkeypatch):
    """A run stopped during the manifest build leaves a record with the cold builds; the report says
    the manifest did not finish."""
    out = tmp_path / "bench-build.json"
    seen = []

    def stopped(*args):
        seen.append(json.loads(out.read_text()))
        raise KeyboardInterrupt  # what a timeout's signal amounts to here

    monkeypatch.setattr(_cold_build, "ours", lambda spec: _cold_build.Timing(2.5))
    monkeypatch.setattr(_manifest_build, "build", stopped)
    with pytest.raises(KeyboardInterrupt):
        build.main(["--no-peers", "--out", str(out)])
    (record,) = seen
    assert [r["cold_build_s"] for r in record["tables"]["build"]] == [2.5] * 4
    assert record["config"]["flashinfer_note"] == "not run (--no-peers)" and "manifest" not in record["tables"]
    assert record["config"]["manifest"]["command"].startswith("attnforge build --arch 90a -j ")
    text = report.render(report.load([str(out)]))
    assert "did not finish" in text and "| prefill fa3 bf16 hd128 | sm_90a | 2.5 | n/a | n/a |" in text


def test_a_failed_build_of_ours_exits_1_with_its_tail(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_cold_build, "ours", lambda spec: _cold_build.Timing(None, "exit 1: nvcc fatal: x"))
    assert build.main(["--no-peers", "--no-manifest", "--families", "decode-fa2", "--out",
                       str(tmp_path / "b.json")]) == 1
    row = json.loads((tmp_path / "b.json").read_text())["tables"]["build"][0]
    assert row["cold_build_s"] is None and row["notes"] == "our build failed (exit 1: nvcc fatal: x)"
    assert "nvcc fatal: x" in capsys.readouterr().out


@pytest.mark.nvcc
def test_a_real_run_times_cold_builds_and_the_manifest(tiny_build, tmp_path, monkeypatch):
    """bench build on sm80 with the smallest module, cold, then `attnforge build` of the run's one-module
    manifest (tiny_build's) into an empty cache."""
    monkeypatch.setenv("MAX_JOBS", os.environ.get("MAX_JOBS", "1"))
    path = tiny_build.manifest
    out = tmp_path / "bench-build.json"
    assert build.main(["--arch", "80", "--families", "decode-fa2", "--manifest", str(path), "-j", "1",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    (cold,) = record["tables"]["build"]
    assert cold["module"] == "decode fa2 bf16 hd128" and cold["arch"] == "sm_80" and cold["cold_build_s"] > 1
    assert record["config"]["flashinfer_note"] == "not run: no sm_90a row with a FlashInfer counterpart"
    (spec,) = manifest.load(path).specs
    (module,) = record["tables"]["manifest"]
    (total,) = record["tables"]["manifest_total"]
    assert module["module"] == spec.uri and module["status"] == "built" and 1 < module["seconds"] <= total["build_s"]
    assert total["build_s"] < total["wall_s"] and (total["modules"], total["built"], total["exit_code"]) == (1, 1, 0)
    assert 1 < total["cpu_s"] < total["wall_s"] * os.cpu_count()  # nvcc's time is counted, bounded by the cores
    assert module["size_mib"] > 0
    text = report.render(report.load([str(out)]))
    assert f"| {spec.uri} | {module['seconds']:.1f} | {module['size_mib']:.1f} |" in text


def test_a_manifest_build_that_prints_no_table_is_recorded_and_rendered(tmp_path, monkeypatch):
    """A manifest attnforge build refuses (exit 2, nothing compiled): the benchmark exits 1 and the report
    says why in one sentence."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[[group]]\nkind = "decode"\n')
    out = tmp_path / "bench-build.json"
    monkeypatch.setattr(_cold_build, "ours", lambda spec: _cold_build.Timing(2.0))
    assert build.main(["--no-peers", "--families", "decode-fa2", "--manifest", str(bad), "--out", str(out)]) == 1
    (total,) = json.loads(out.read_text())["tables"]["manifest_total"]
    assert (total["modules"], total["built"], total["failed"], total["exit_code"]) == (0, 0, 0, 2)
    assert total["notes"] == "no closing table (a 'module  seconds  size' header) in attnforge build's output; exit 2"
    text = " ".join(report.render(report.load([str(out)])).split())
    assert "0 modules (0 built, 0 failed) in" in text and "exit status 2; no closing table" in text
