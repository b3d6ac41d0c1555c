"""The `attnforge` command line, driven through main(argv) (exit status plus printed text)."""

from __future__ import annotations

import sys
import types

import pytest

from attnforge.codegen import manifest
from attnforge.codegen.cli import main

DECODE_128 = ["--kind", "decode", "--backend", "fa2", "--dtype-q", "bf16", "--head-dim", "128", "--arch", "80"]


def test_generate_one_spec(tmp_path, capsys):
    assert main(["generate", *DECODE_128, "--out", str(tmp_path)]) == 0
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("decode_fa2_qbf16_kvbf16_obf16_i32_hd128_")
    assert (folder / "metadata.json").is_file() and list(folder.glob("*.cu"))
    out = capsys.readouterr().out
    assert folder.name in out and "1 module(s) written" in out


def test_generate_refused_spec_writes_nothing(tmp_path, capsys):
    args = ["generate", "--kind", "decode", "--backend", "fa3", "--dtype-q", "bf16", "--dtype-kv", "e4m3",
            "--head-dim", "128", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    out = capsys.readouterr().out
    # fa3 is a prefill family: the decode spec is refused for that cause alone, without fa3 advice on top
    assert "decode-is-fa2" in out and "fa3-" not in out
    assert not (tmp_path / "out").exists()


def _manifest_with_a_stale_module(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[[group]]\nkind = "decode"\nbackend = "fa2"\ndtype_q = "fp16"\ndtype_kv = "same_as_q"\n'
                    'dtype_o = "same_as_q"\nhead_dim = [64, 144]\narchs = "80"\n')
    out_dir = tmp_path / "gen"
    stale = out_dir / "decode_old_module"
    stale.mkdir(parents=True)
    (stale / "metadata.json").write_text("{}")
    return path, out_dir, stale


def test_generate_manifest_keeps_other_modules_and_names_them(tmp_path, capsys):
    """Issue 39: generate --out into a folder removed every module there ("91 stale removed") unasked."""
    path, out_dir, stale = _manifest_with_a_stale_module(tmp_path)
    assert main(["generate", "--manifest", str(path), "--out", str(out_dir)]) == 0
    assert stale.is_dir() and len(list(out_dir.iterdir())) == 2
    out = capsys.readouterr().out
    assert "kept decode_old_module (not in the manifest; --prune removes it)" in out
    assert "1 refused by rules (decode-head-dims)" in out and "1 stale kept (--prune removes them)" in out


def test_generate_prune_removes_stale_modules_and_names_them(tmp_path, capsys):
    path, out_dir, _ = _manifest_with_a_stale_module(tmp_path)
    assert main(["generate", "--manifest", str(path), "--out", str(out_dir), "--prune"]) == 0
    (folder,) = out_dir.iterdir()
    assert "_hd64_" in folder.name
    out = capsys.readouterr().out
    assert "removed decode_old_module (not in the manifest)" in out and "1 stale removed" in out


def test_generate_prune_needs_a_manifest(tmp_path, capsys):
    assert main(["generate", *DECODE_128, "--out", str(tmp_path), "--prune"]) == 2
    assert "--prune removes the modules a manifest no longer lists" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_generate_of_a_manifest_that_yields_nothing_fails_and_removes_nothing(tmp_path, capsys):
    """Issue 39: every combination refused exited 0 and then pruned the whole --out folder."""
    path, out_dir, stale = _manifest_with_a_stale_module(tmp_path)
    path.write_text('[[group]]\nkind = "decode"\nbackend = "fa3"\ndtype_q = "bf16"\nhead_dim = 128\n')
    assert main(["generate", "--manifest", str(path), "--out", str(out_dir), "--prune"]) == 2
    err = capsys.readouterr().err
    assert err == (f"attnforge generate: error: {path}: the manifest yields no module: rules refuse all 1 "
                   'combination(s) (decode-is-fa2 x1); set on_invalid = "error" in a group to see why\n')
    assert [p.name for p in out_dir.iterdir()] == [stale.name]


def test_validate_valid(capsys):
    assert main(["validate", *DECODE_128]) == 0
    assert capsys.readouterr().out.startswith("ok decode_fa2_qbf16")


def test_validate_invalid_prints_every_rule_with_its_suggestion(capsys):
    args = ["validate", "--kind", "prefill", "--backend", "fa3", "--dtype-q", "fp16", "--dtype-kv", "e4m3",
            "--dtype-o", "e4m3", "--arch", "90a"]
    assert main(args) == 2
    out = capsys.readouterr().out
    for rule_id in ("fa3-fp8-kv-needs-fp8-q", "o-not-fp8"):
        assert f"[{rule_id}]" in out
    assert "-> use backend fa2" in out


def test_validate_default_manifest(capsys):
    assert main(["validate"]) == 0
    assert capsys.readouterr().out.count("ok ") == len(manifest.load(manifest.default_manifest_path()).specs)


def test_head_dim_qk_and_vo(capsys):
    assert main(["validate", "--head-dim-qk", "192", "--head-dim-vo", "128"]) == 2
    assert "hd192x128" in capsys.readouterr().out


def test_list_prints_uris(capsys):
    assert main(["list"]) == 0
    uris = capsys.readouterr().out.split()
    assert uris == [s.uri for s in manifest.load(manifest.default_manifest_path()).specs]


def test_matrix_names_rules(capsys):
    assert main(["matrix", "--kind", "prefill", "--backend", "fa3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| kind |") and "fa3-fp8-kv-needs-fp8-q" in out and "| decode |" not in out


def test_bench_unknown_name(capsys):
    assert main(["bench", "no_such_benchmark", "--batch", "4"]) == 2
    assert "unknown benchmark 'no_such_benchmark'" in capsys.readouterr().err


def test_bench_forwards_the_remaining_arguments(tmp_path, monkeypatch, capsys):
    # A stand-in benchmarks package, so the test does not depend on which benchmarks exist.
    (tmp_path / "fake_bench.py").write_text("def main(argv):\n    print('got', argv)\n    return 3\n")
    package = types.ModuleType("attnforge.benchmarks")
    package.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "attnforge.benchmarks", package)
    try:
        assert main(["bench", "fake_bench", "--batch", "4", "--help"]) == 3
    finally:
        sys.modules.pop("attnforge.benchmarks.fake_bench", None)
    assert "got ['--batch', '4', '--help']" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["validate", "--dtype-q", "bf17"], "unknown dtype 'bf17'"),
        (["validate", "--head-dim", "12x"], "head dim must be a positive integer"),
        (["validate", "--arch", "75"], "unknown arch"),
        (["validate", "--kind", "encode"], "--kind"),
        # issue 39: enum errors list the choices ("'auto' is not a valid Backend" did not)
        (["validate", "--kind", "prefil"], "argument --kind: unknown kind 'prefil'; expected one of prefill, decode"),
        (["validate", "--backend", "auto"], "argument --backend: unknown backend 'auto'; expected one of fa2, fa3"),
        (["matrix", "--backend", "fa4"], "unknown backend 'fa4'; expected one of fa2, fa3"),
        (["validate", "--pos-encoding", "rope"], "expected one of NONE, ROPE_LLAMA, ALIBI"),
        # issue 39: no kernel accumulates q.k in fp16, so the flag is not offered
        (["validate", "--fp16-qk-reduction"], "unrecognized arguments: --fp16-qk-reduction"),
        (["bench"], "name a benchmark; available: build, decode, fp8, prefill, report"),
        (["list", "--manifest", "/does/not/exist.toml"], "does not exist"),
        (["generate", "--manifest", "m.toml", "--kind", "decode"], "not both"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_give_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_invalid_toml_manifest(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[[group]\n")
    assert main(["validate", "--manifest", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and len(err.strip().splitlines()) == 1


def test_help_explains_specs_and_gives_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "spec" in out and "attnforge generate" in out
    for command in ("generate", "validate", "list", "matrix", "bench"):
        assert main([command, "--help"]) == 0
        assert f"attnforge {command}" in capsys.readouterr().out.split("example:")[1]


def test_bench_help_lists_the_benchmarks_and_report(capsys):
    assert main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out.split("available benchmarks:")[1]
    names = [line.split()[0] for line in listed.strip().splitlines()]
    assert names == ["build", "decode", "fp8", "prefill", "report"]
    assert "Batch decode benchmark" in listed


def test_bench_report_renders_a_record(tmp_path, capsys):
    import json

    record = {"schema": 1, "benchmark": "build", "date": "2026-12-03T10:11:12Z", "gpu": "NVIDIA H200",
              "commit": "unknown", "attnforge_version": "0.1.0", "torch": "2.11.0", "cuda": "13.0",
              "config": {"what": "cold", "cpu_count": 16, "nvcc": "13.0", "flashinfer_version": None,
                         "flashinfer_what": "", "flashinfer_note": "not run (--no-peers)", "manifest": None},
              "tables": {"build": [{"module": "decode fa2 bf16 hd128", "arch": "sm_90a", "cold_build_s": 4.4,
                                    "flashinfer_s": None, "notes": ""}]}}
    path = tmp_path / "bench-build.json"
    path.write_text(json.dumps(record))
    assert main(["bench", "report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Benchmarks") and "| decode fa2 bf16 hd128 | sm_90a | 4.4 | n/a | n/a |" in out


def test_fa3_for_sm80_gives_one_rule_with_one_piece_of_advice(capsys):
    """Issue 39: fa3 with --arch 80 printed two rules whose advice conflicted (add sm90a / only sm90a)."""
    assert main(["validate", "--kind", "prefill", "--backend", "fa3", "--arch", "80"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("refused prefill_fa3_") and len(out) == 2
    assert out[1].startswith("  [fa3-needs-sm90a]") and "target sm90a alone, or use backend fa2" in out[1]


def test_no_spec_option_is_refused_by_every_spec():
    """Issue 39: --fp16-qk-reduction was offered though every kind and backend refused it. Each flag must be
    accepted by at least one valid spec (the default manifest holds one for each)."""
    from attnforge.codegen.cli import _spec_options

    flags = {a.dest for a in _spec_options()._actions if a.const is True}
    specs = manifest.load(manifest.default_manifest_path()).specs
    assert flags and all(any(getattr(spec, flag) for spec in specs) for flag in flags), flags


GROUP = '[[group]]\nkind = "decode"\nbackend = "fa2"\ndtype_q = "bf16"\nhead_dim = 128\n'


@pytest.mark.parametrize("command", ["validate", "list", "generate"])
@pytest.mark.parametrize("text, message", [
    (b"\xff\xfe" + GROUP.encode(), "not UTF-8 text (byte 0xff on line 1)"),
    ("defaults = 3\n" + GROUP, "defaults: expected a table ([defaults]), got 3"),
    ('group = ["decode"]\n', 'group[0]: expected a table ([[group]]), got "decode"'),
    ('[defualts]\nkind = "decode"\n' + GROUP, "unknown top-level [defualts]; did you mean [defaults]?"),
    ('[[groups]]\n' + GROUP.split("\n", 1)[1], "unknown top-level [[groups]]; did you mean [[group]]?"),
    ('[[group]]\ndtype_q = "bf16"\nhead_dim = 64\n', "group[0]: missing kind, backend (give them in the group"),
    (GROUP.replace("head_dim = 128", 'head_dim = "128"'), 'group[0].head_dim: expected a positive int, got "128"'),
    (GROUP.replace('"fa2"', '"fa3"'), "the manifest yields no module: rules refuse all 1 combination(s)"),
])
def test_malformed_manifest_is_one_line_with_status_2(tmp_path, capsys, command, text, message):
    """Issue 39's observed manifests: tracebacks, silence, or messages that did not name the field."""
    path = tmp_path / "m.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    argv = [command, "--manifest", str(path)] + (["--out", str(tmp_path / "out")] if command == "generate" else [])
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"attnforge {command}: error: {path}: " + captured.err.split(f"{path}: ", 1)[1]
    assert message in captured.err and len(captured.err.splitlines()) == 1 and "Traceback" not in captured.err
    assert not (tmp_path / "out").exists()
