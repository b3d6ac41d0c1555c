"""Prebuilt packages: `attnforge package` writes a well-formed wheel; installed, its module loads in a
process with no compiler at all; a package of another attnforge version is never loaded; a tampered
library is skipped with one warning and the cache serves the module instead (needs nvcc once, to
build the tiny module; no GPU)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from attnforge import prebuilt
from attnforge.build import version
from attnforge.codegen.cli import main
from attnforge.codegen.sources import source_hash
from attnforge.loader import load_uncached

pytestmark = pytest.mark.nvcc

PACKAGE = "attnforge_modules_tiny"


@pytest.fixture(scope="module")
def wheel(tiny_build, tmp_path_factory) -> Path:
    assert tiny_build.result.returncode == 0, tiny_build.result.stderr
    out = tmp_path_factory.mktemp("wheel")
    assert main(["package", "--manifest", str(tiny_build.manifest), "--cache-dir", str(tiny_build.cache),
                 "--name", "tiny", "--out", str(out)]) == 0
    (path,) = out.glob("*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed by pip into a folder of its own (put on PYTHONPATH by the processes that use it)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    return target


def _b64_sha256(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_wheel_name_and_dist_info(wheel):
    assert wheel.name.startswith(f"{PACKAGE}-{version()}-py3-none-linux_")
    with zipfile.ZipFile(wheel) as archive:
        dist_info = f"{PACKAGE}-{version()}.dist-info"
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        assert "Name: attnforge-modules-tiny\n" in metadata and f"Requires-Dist: attnforge=={version()}" in metadata
        assert "Root-Is-Purelib: false" in archive.read(f"{dist_info}/WHEEL").decode()
        assert archive.read(f"{dist_info}/entry_points.txt").decode() == f"[attnforge.prebuilt]\ntiny = {PACKAGE}\n"
        rows = list(csv.reader(io.StringIO(archive.read(f"{dist_info}/RECORD").decode())))
        assert sorted(row[0] for row in rows) == sorted(archive.namelist())
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                assert digest == size == ""
                continue
            data = archive.read(name)
            assert digest == _b64_sha256(data) and int(size) == len(data)


def test_wheel_records_each_module(wheel, tiny_build):
    spec = tiny_build.spec
    with zipfile.ZipFile(wheel) as archive:
        index = json.loads(archive.read(f"{PACKAGE}/prebuilt.json"))
        library = archive.read(f"{PACKAGE}/{spec.uri}/{spec.uri}.so")
        assert archive.read(f"{PACKAGE}/{spec.uri}/src/binding.py").startswith(b'"""')
    cached = tiny_build.library.read_bytes()
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    assert index["attnforge_version"] == version()
    assert index["modules"] == {spec.uri: {
        "spec": spec.to_dict(), "source_hash": source_hash(), "build_options": [], "archs": ["80"], "nvcc_version": nvcc,
        "library": f"{spec.uri}/{spec.uri}.so", "size": len(cached), "sha256": hashlib.sha256(cached).hexdigest()}}
    assert library == cached


# Loads the spec given as JSON in a process where no nvcc can be found; prints the library's path.
LOAD_SCRIPT = textwrap.dedent("""
    import json, shutil, sys
    from attnforge.codegen.spec import KernelSpec
    from attnforge.loader import load_uncached
    assert shutil.which("nvcc") is None, "nvcc is still on the PATH"
    module = load_uncached(KernelSpec.from_dict(json.loads(sys.argv[1])))
    print(module.path)
""")


def _run_without_compiler(spec, tmp_path: Path, **env_extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Load `spec` in a fresh process whose PATH holds no nvcc, with CUDA_HOME unset and ATTNFORGE_NVCC
    a spy that records each call and fails. Returns the process and the spy's record file."""
    record = tmp_path / "nvcc-calls"
    spy = tmp_path / "nvcc-spy"
    spy.write_text(f"#!/bin/sh\necho \"$@\" >> {shlex.quote(str(record))}\necho 'nvcc spy: no compiler' >&2\nexit 1\n")
    spy.chmod(0o755)
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not Path(d, "nvcc").exists())
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_HOME", "CUDA_PATH", "ATTNFORGE_PREBUILT_PATH", "PYTHONPATH")}
    env.update(PATH=path, ATTNFORGE_NVCC=str(spy), ATTNFORGE_CACHE_DIR=str(tmp_path / "cache"), **env_extra)
    result = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, json.dumps(spec.to_dict())], env=env,
                            capture_output=True, text=True, timeout=300)
    return result, record


def test_installed_package_loads_with_no_compiler(installed, tiny_build, tmp_path):
    result, record = _run_without_compiler(tiny_build.spec, tmp_path, PYTHONPATH=str(installed))
    assert result.returncode == 0, result.stderr
    uri = tiny_build.spec.uri
    assert Path(result.stdout.strip()) == installed / PACKAGE / uri / f"{uri}.so"
    assert not record.exists()  # the spy never ran
    assert not (tmp_path / "cache").exists()  # no lock file, no build folder: nothing written


def test_package_of_another_version_is_ignored(installed, tiny_build, tmp_path):
    skewed = tmp_path / "skewed"
    shutil.copytree(installed / PACKAGE, skewed)
    index = json.loads((skewed / "prebuilt.json").read_text())
    index["attnforge_version"] = "0.0.1"
    (skewed / "prebuilt.json").write_text(json.dumps(index))
    result, record = _run_without_compiler(tiny_build.spec, tmp_path, ATTNFORGE_PREBUILT_PATH=str(skewed))
    assert result.returncode != 0
    line = f"ignoring prebuilt package {skewed}: built by attnforge 0.0.1, this is attnforge {version()}"
    assert result.stderr.count(line) == 1
    assert "BuildError: ninja failed" in result.stderr and "nvcc spy: no compiler" in result.stderr
    assert record.exists()  # it went on to build, as without the package


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings():
    handler = _Warnings()
    logger = logging.getLogger("attnforge")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_prebuilt_path_folder_is_found(installed, tiny_build, monkeypatch):
    monkeypatch.setenv("ATTNFORGE_PREBUILT_PATH", os.pathsep.join(["", str(installed / PACKAGE)]))
    uri = tiny_build.spec.uri
    assert prebuilt.find(tiny_build.spec) == installed / PACKAGE / uri / f"{uri}.so"


def test_module_built_with_other_build_options_is_not_used(installed, tiny_build, tmp_path, monkeypatch):
    """A package records its build options (extra nvcc flags, CUTLASS_DIR); a reader with other ones
    builds its own module instead, as the cache does."""
    folder = tmp_path / "lineinfo"
    shutil.copytree(installed / PACKAGE, folder)
    index = json.loads((folder / "prebuilt.json").read_text())
    index["modules"][tiny_build.spec.uri]["build_options"] = ["-lineinfo"]
    (folder / "prebuilt.json").write_text(json.dumps(index))
    monkeypatch.setenv("ATTNFORGE_PREBUILT_PATH", str(folder))
    monkeypatch.delenv("ATTNFORGE_EXTRA_CUDAFLAGS", raising=False)
    assert prebuilt.find(tiny_build.spec) is None
    monkeypatch.setenv("ATTNFORGE_EXTRA_CUDAFLAGS", "-lineinfo")
    uri = tiny_build.spec.uri
    assert prebuilt.find(tiny_build.spec) == folder / uri / f"{uri}.so"


@pytest.mark.parametrize("damage, why", [
    (lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]), "its sha256 differs"),
    (lambda data: data[: len(data) // 2], "it is truncated"),
])
def test_damaged_library_warns_once_and_the_cache_serves(damage, why, installed, tiny_build, tmp_path, monkeypatch,
                                                         warnings):
    folder = tmp_path / "damaged"
    shutil.copytree(installed / PACKAGE, folder)
    uri = tiny_build.spec.uri
    library = folder / uri / f"{uri}.so"
    library.write_bytes(damage(library.read_bytes()))
    monkeypatch.setenv("ATTNFORGE_PREBUILT_PATH", str(folder))
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tiny_build.cache))
    assert prebuilt.find(tiny_build.spec) is None
    module = load_uncached(tiny_build.spec)
    assert module.path == tiny_build.library
    assert [m for m in warnings if str(library) in m] == [m for m in warnings if why in m]
    assert len([m for m in warnings if why in m]) == 1


def test_prebuilt_path_without_index_warns_naming_the_variable(tiny_build, tmp_path, monkeypatch, warnings):
    monkeypatch.setenv("ATTNFORGE_PREBUILT_PATH", str(tmp_path))
    assert prebuilt.find(tiny_build.spec) is None
    assert warnings == [f"prebuilt package {tmp_path} has no prebuilt.json (check ATTNFORGE_PREBUILT_PATH); ignored"]


def test_from_cache_packages_every_verified_module_and_nothing_else(tiny_build, tmp_path, capsys):
    """--from-cache ships what a cache holds (e.g. every module a test run compiled): the verified
    module goes in; a copy whose library was altered and a folder of a stale uri stay out."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_build.cache, cache)
    root = cache / version()
    stale = root / (tiny_build.spec.uri[:-10] + "0" * 10)  # a module folder from other sources
    shutil.copytree(root / tiny_build.spec.uri, stale)
    assert main(["package", "--from-cache", "--cache-dir", str(cache), "--name", "ci", "--out", str(tmp_path)]) == 0
    (wheel,) = tmp_path.glob("attnforge_modules_ci-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        index = json.loads(archive.read("attnforge_modules_ci/prebuilt.json"))
    assert list(index["modules"]) == [tiny_build.spec.uri]

    library = root / tiny_build.spec.uri / f"{tiny_build.spec.uri}.so"
    data = library.read_bytes()
    library.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # altered after its record
    assert main(["package", "--from-cache", "--cache-dir", str(cache), "--name", "ci2", "--out", str(tmp_path)]) == 2
    assert "no built module" in capsys.readouterr().err


def test_from_cache_refuses_a_selection(tiny_build, tmp_path, capsys):
    assert main(["package", "--from-cache", "--arch", "90a", "--cache-dir", str(tiny_build.cache), "--name", "x",
                 "--out", str(tmp_path)]) == 2
    assert "--from-cache packages what the cache holds" in capsys.readouterr().err
