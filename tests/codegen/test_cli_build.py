"""`attnforge build`: a manifest compiled into a cache, skipped when already built, failures named
with their compiler output, --arch replacing the manifest's archs, and bad input refused."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from attnforge import integrity
from attnforge.build import library_path
from attnforge.codegen.cli import main
from attnforge.codegen.spec import Arch
from attnforge.settings import settings


def _cache_settings(cache):
    return dataclasses.replace(settings(), cache_dir=cache)


@pytest.mark.nvcc
def test_build_compiles_the_manifest_then_skips_it(tiny_build, capsys):
    first = tiny_build.result
    assert first.returncode == 0, first.stderr
    uri = tiny_build.spec.uri
    library = tiny_build.library
    assert library.is_file()
    assert uri in first.stdout and "1 built, 0 cached, 0 failed" in first.stdout
    built_at = library.stat().st_mtime_ns

    assert main(["build", "--manifest", str(tiny_build.manifest), "--cache-dir", str(tiny_build.cache)]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith(uri)]
    assert row.split()[1] == "cached" and "0 built, 1 cached, 0 failed" in out
    assert library.stat().st_mtime_ns == built_at


@pytest.mark.nvcc
def test_build_failure_exits_nonzero_naming_the_module_and_compiler_output(tiny_build, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.setenv("ATTNFORGE_EXTRA_CUDAFLAGS", "--no-such-nvcc-flag")
    status = main(["build", "--manifest", str(tiny_build.manifest), "--cache-dir", str(tmp_path / "cache")])
    captured = capsys.readouterr()
    assert status == 1
    assert f"1 module(s) failed to build: {tiny_build.spec.uri}" in captured.err
    assert "no-such-nvcc-flag" in captured.err  # nvcc's own complaint, from the compiler tail
    assert "FAILED" in captured.out and "0 built, 0 cached, 1 failed" in captured.out
    assert not library_path(tiny_build.spec, _cache_settings(tmp_path / "cache")).exists()


@pytest.mark.nvcc
def test_extra_cuda_flags_build_a_module_of_their_own(tiny_build, tmp_path, monkeypatch, capsys):
    """ATTNFORGE_EXTRA_CUDAFLAGS is not in the uri: with it set, the module builds into a folder of its
    own instead of the plain module being taken for it, and the plain one is left as it was."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_build.cache, cache)
    plain = library_path(tiny_build.spec, _cache_settings(cache))
    pristine = plain.read_bytes()
    build = ["build", "--manifest", str(tiny_build.manifest), "--cache-dir", str(cache)]
    monkeypatch.setenv("ATTNFORGE_EXTRA_CUDAFLAGS", "-lineinfo")
    assert main(build) == 0
    assert "1 built, 0 cached, 0 failed" in capsys.readouterr().out
    flagged = library_path(tiny_build.spec, _cache_settings(cache))
    assert flagged.parent.parent.name.startswith("options-") and integrity.problem(flagged) is None
    assert flagged.read_bytes() != pristine  # -lineinfo adds the line table
    assert plain.read_bytes() == pristine
    monkeypatch.delenv("ATTNFORGE_EXTRA_CUDAFLAGS")
    assert main(build) == 0
    assert "0 built, 1 cached, 0 failed" in capsys.readouterr().out


def test_arch_replaces_the_manifest_archs(tmp_path, capsys):
    """The manifest says sm80; --arch 90a asks for the sm90a module instead (a recorded library already in
    the cache stands in for it, so nothing compiles)."""
    from attnforge.codegen import manifest

    path = tmp_path / "m.toml"
    path.write_text('[[group]]\nkind = "decode"\nbackend = "fa2"\ndtype_q = "bf16"\ndtype_kv = "same_as_q"\n'
                    'dtype_o = "default"\nhead_dim = 128\narchs = ["80", "90a"]\n')
    sm90a = [s for s in manifest.load(path).specs if s.archs == (Arch.SM90A,)][0]
    library = library_path(sm90a, _cache_settings(tmp_path / "cache"))
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\0" * 2**20)
    integrity.write_record(library)  # installed as a build installs it: the pool takes it as built
    assert main(["build", "--manifest", str(path), "--arch", "90a", "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("decode_")]
    assert rows == [f"{sm90a.uri}    cached     1.0 MiB"]


def test_arch_that_no_spec_accepts_is_refused(tmp_path, capsys):
    path = tmp_path / "m.toml"
    path.write_text('[[group]]\nkind = "prefill"\nbackend = "fa3"\ndtype_q = "bf16"\ndtype_kv = "same_as_q"\n'
                    'dtype_o = "default"\nhead_dim = 128\narchs = "90a"\n')
    assert main(["build", "--manifest", str(path), "--arch", "80", "--cache-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "skipped prefill_fa3" in captured.out and "fa3-needs-sm90a" in captured.out
    assert "no spec of the manifest is valid for --arch 80" in captured.err


@pytest.mark.parametrize("args, message", [
    (["--manifest", "m.toml", "--kind", "decode"], "give either --manifest or spec options"),
    (["-j", "0"], "-j must be a positive integer, got '0'"),
    (["--manifest", "missing.toml"], "manifest missing.toml does not exist"),
])
def test_build_bad_input_is_one_line(args, message, capsys):
    assert main(["build", *args]) == 2
    assert message in capsys.readouterr().err


def test_build_help_says_how_long_a_build_takes(capsys):
    assert main(["build", "--help"]) == 0
    out = capsys.readouterr().out
    assert "16 cores" in out and "15 s (fa3 prefill bf16)" in out and "140 s" in out


def test_a_relative_cache_dir_option_is_made_absolute(tmp_path, monkeypatch):
    """ninja runs each build in its own folder, so --cache-dir is resolved against the working directory first."""
    import argparse

    from attnforge.codegen import cli

    monkeypatch.chdir(tmp_path)
    config = cli._cache_settings(argparse.Namespace(cache_dir=Path("rel")))
    assert config.cache_dir == tmp_path / "rel"
