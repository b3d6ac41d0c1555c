"""The cache in deployment conditions: damaged libraries (truncated, empty, altered, unrecorded, not
loadable) are rebuilt or refused with one clear error and never crash the interpreter; a read-only
cache of valid modules loads without writing; paths with spaces, `$` and `:` build; an unwritable
home falls back or names ATTNFORGE_CACHE_DIR; bad environment values are named; a killed build leaves
no compiler running.

Most tests drive the real ninja with a stand-in compiler (FAKE_NVCC below) that records its
arguments and links a given library, so they run without nvcc. The tests marked nvcc share one real
module built once per session in a cache path with a space, and copy its cache before damaging it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from attnforge import build as build_module
from attnforge import integrity
from attnforge.build import CacheError, build, library_path, module_dir, ninja_path
from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind
from attnforge.loader import load_uncached
from attnforge.settings import SettingsError, settings

SPEC = KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                  dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM80,))
IS_ROOT = os.geteuid() == 0

FAKE_NVCC = f"""#!{sys.executable}
# Stand-in for nvcc: logs its argv (FAKE_NVCC_LOG), lingers with a child process like cicc when
# FAKE_NVCC_LINGER names a file (writing its pid and the child's there), then writes its outputs;
# the link step copies FAKE_NVCC_LIBRARY.
import json, os, shutil, subprocess, sys
args = sys.argv[1:]
if os.environ.get("FAKE_NVCC_LOG"):
    with open(os.environ["FAKE_NVCC_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_NVCC_LINGER"):
    child = subprocess.Popen(["sleep", "120"])
    with open(os.environ["FAKE_NVCC_LINGER"], "a") as pids:
        pids.write(f"{{os.getpid()}} {{child.pid}}\\n")
    child.wait()
out = args[args.index("-o") + 1]
if "-MF" in args:
    with open(args[args.index("-MF") + 1], "w") as dep:
        dep.write(out + ":\\n")
if "-shared" in args:
    shutil.copyfile(os.environ["FAKE_NVCC_LIBRARY"], out)
else:
    with open(out, "w") as obj:
        obj.write("object\\n")
"""


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """A stand-in compiler in a folder whose name needs quoting, set as ATTNFORGE_NVCC."""
    folder = tmp_path / "tool dir $x"
    folder.mkdir()
    path = folder / "nvcc"
    path.write_text(FAKE_NVCC)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    library = tmp_path / "fake.so"
    library.write_bytes(b"not a real library\n")
    monkeypatch.setenv("ATTNFORGE_NVCC", str(path))
    monkeypatch.setenv("FAKE_NVCC_LIBRARY", str(library))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(tmp_path / "nvcc.log"))
    monkeypatch.delenv("FAKE_NVCC_LINGER", raising=False)
    return path


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


# --- environment values ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ATTNFORGE_DEBUG", "ATTNFORGE_JIT_VERBOSE"])
def test_junk_boolean_is_named_with_accepted_values(monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(SettingsError) as raised:
        settings()
    assert f"{name}='maybe'" in str(raised.value) and "true" in str(raised.value) and "off" in str(raised.value)


@pytest.mark.parametrize("value, expected", [("1", True), (" TRUE ", True), ("on", True), ("yes", True),
                                             ("0", False), ("off", False), ("", False), ("No", False)])
def test_boolean_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("ATTNFORGE_DEBUG", value)
    assert settings().debug is expected


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_bad_max_jobs_is_named(monkeypatch, value):
    monkeypatch.setenv("MAX_JOBS", value)
    with pytest.raises(SettingsError, match=f"MAX_JOBS='{value}' is not a positive integer"):
        settings()


def test_max_jobs_is_read(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", " 3 ")
    assert settings().max_jobs == 3


def test_bad_arch_list_is_named(monkeypatch):
    monkeypatch.setenv("ATTNFORGE_CUDA_ARCH_LIST", "8.0 bogus")
    with pytest.raises(SettingsError) as raised:
        settings()
    message = str(raised.value)
    assert "ATTNFORGE_CUDA_ARCH_LIST='8.0 bogus'" in message and "'bogus'" in message and "90a" in message


def _import_attnforge(log_level: str) -> subprocess.CompletedProcess:
    code = "import logging, attnforge; print(logging.getLogger('attnforge').level)"
    env = {**os.environ, "ATTNFORGE_LOG_LEVEL": log_level}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_bad_log_level_warns_once_and_import_succeeds():
    result = _import_attnforge("verbose")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(logging.INFO)
    warnings = [line for line in result.stderr.splitlines() if "ATTNFORGE_LOG_LEVEL" in line]
    assert len(warnings) == 1, result.stderr
    assert "'verbose'" in warnings[0] and "DEBUG" in warnings[0] and "WARNING" in warnings[0]


def test_log_level_is_case_insensitive():
    result = _import_attnforge("debug")
    assert result.returncode == 0 and result.stdout.strip() == str(logging.DEBUG)
    assert "ATTNFORGE_LOG_LEVEL" not in result.stderr


# --- where the cache goes -------------------------------------------------------------------------

def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in. root ignores permission bits, so there it is a
    path under a regular file instead (creating it fails for anyone)."""
    if IS_ROOT:
        blocker = tmp_path / "a file"
        blocker.write_text("")
        return blocker / "home"
    folder = tmp_path / "locked home"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


@pytest.fixture
def unwritable_home(tmp_path, monkeypatch):
    home = _unwritable_folder(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("ATTNFORGE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    yield home
    if not IS_ROOT:
        home.chmod(0o755)


def test_unwritable_home_falls_back_to_a_private_temp_folder(unwritable_home, caplog):
    caplog.set_level(logging.INFO, logger="attnforge")
    chosen = settings().cache_dir
    assert chosen == Path(tempfile.gettempdir()) / f"attnforge-{os.getuid()}"
    assert not settings().cache_dir_from_env
    fallback_lines = [m for m in caplog.messages if str(chosen) in m]
    assert len(fallback_lines) == 1 and str(unwritable_home) in fallback_lines[0]
    assert "ATTNFORGE_CACHE_DIR" in fallback_lines[0]


def test_unwritable_home_prefers_xdg_cache_home(unwritable_home, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings().cache_dir == tmp_path / "xdg" / "attnforge"


def test_temp_fallback_owned_by_someone_else_is_not_used(unwritable_home, monkeypatch):
    uid = os.getuid() + 1000  # this process, seen as another user than the folder's owner
    planted = Path(tempfile.gettempdir()) / f"attnforge-{uid}"
    planted.mkdir()
    monkeypatch.setattr(os, "getuid", lambda: uid)
    assert settings().cache_dir != planted


def test_no_writable_cache_names_the_variable_when_a_build_is_needed(unwritable_home, monkeypatch, tmp_path):
    blocker = tmp_path / "tmp file"
    blocker.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))
    with pytest.raises(CacheError) as raised:
        build(SPEC)
    message = str(raised.value)
    assert f"cannot build {SPEC.uri}" in message and "ATTNFORGE_CACHE_DIR" in message
    assert str(unwritable_home) in message


def test_unwritable_cache_dir_variable_is_named_with_its_path(tmp_path, monkeypatch):
    cache = _unwritable_folder(tmp_path) / "cache"
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(cache))
    try:
        with pytest.raises(CacheError, match=f"ATTNFORGE_CACHE_DIR={cache} is not writable"):
            build(SPEC)
    finally:
        if not IS_ROOT:
            cache.parent.chmod(0o755)


# --- paths that need escaping ---------------------------------------------------------------------

def test_ninja_path_escapes_lexer_characters():
    assert ninja_path("/a b/c:d/$e") == "/a$ b/c$:d/$$e"


def test_build_in_a_path_with_space_dollar_and_colon(tmp_path, monkeypatch, fake_nvcc):
    cache = tmp_path / "my cache $HOME:x"
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(cache))
    library = build(SPEC)
    assert library.parent.parent.parent == cache and integrity.problem(library) is None
    calls = _calls(tmp_path / "nvcc.log")
    src = module_dir(SPEC) / "src"
    compiles = [args for args in calls if "-c" in args]
    assert sorted(args[args.index("-c") + 1] for args in compiles) == sorted(str(p) for p in src.glob("*.cu"))
    assert all(f"-I{src}" in args for args in compiles)  # one argument, unsplit by the shell
    assert sum("-shared" in args for args in calls) == 1


def test_a_relative_cache_dir_is_taken_from_the_working_directory(tmp_path, monkeypatch, fake_nvcc):
    """ninja runs in the build's own folder: a relative ATTNFORGE_CACHE_DIR must not be read from there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", "rel cache")
    library = build(SPEC)
    assert library.is_absolute() and library.is_relative_to(tmp_path / "rel cache")
    assert integrity.problem(library) is None


# --- a killed build --------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _build_in_subprocess(env: dict) -> subprocess.Popen:
    code = textwrap.dedent("""
        import json, signal, sys, time
        from attnforge.build import build
        from attnforge.codegen.spec import KernelSpec
        # Ctrl-C raises KeyboardInterrupt even where the runner started us with SIGINT ignored (a
        # background job of a non-interactive shell is; Python then keeps it ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            print("built", build(KernelSpec.from_dict(json.loads(sys.argv[1]))))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            time.sleep(120)  # a server that survives the interrupt: its build must stop all the same
    """)
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(SPEC.to_dict())], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_killed_build_leaves_no_compiler_and_the_next_build_succeeds(tmp_path, monkeypatch, fake_nvcc, sig):
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(tmp_path / "cache"))
    pids_file = tmp_path / "compiler pids"
    env = {**os.environ, "FAKE_NVCC_LINGER": str(pids_file), "MAX_JOBS": "2"}
    proc = _build_in_subprocess(env)
    _wait_for(lambda: pids_file.exists() and len(pids_file.read_text().splitlines()) == 2, 60,
              "two compilers to start")
    ninja = [pid for pid in _children(proc.pid) if "ninja" in Path(f"/proc/{pid}/cmdline").read_text()]
    compilers = [int(pid) for line in pids_file.read_text().splitlines() for pid in line.split()]
    assert len(ninja) == 1 and len(compilers) == 4
    os.kill(proc.pid, sig)
    if sig == signal.SIGINT:
        seen = []
        for line in iter(proc.stdout.readline, ""):  # lines until it says so (or exits)
            seen.append(line)
            if line == "interrupted\n":
                break
        assert seen and seen[-1] == "interrupted\n", f"the build process said: {''.join(seen)!r}"
    _wait_for(lambda: not any(_alive(pid) for pid in ninja + compilers), 10, "ninja and its compilers to exit")
    proc.kill()
    proc.communicate(timeout=30)
    folder = module_dir(SPEC)
    assert not library_path(SPEC).exists()

    env.pop("FAKE_NVCC_LINGER")
    again = _build_in_subprocess(env)
    output = again.communicate(timeout=120)[0]
    assert again.returncode == 0, output
    assert integrity.problem(library_path(SPEC)) is None
    assert not list(folder.glob("build.*"))  # the killed build's folder was removed


def _mentioning(text: str) -> list[str]:
    """Command lines of live processes (not this one) whose arguments mention `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and _alive(int(entry.name)):
                found.append(cmdline)
    return found


@pytest.mark.nvcc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_real_build_leaves_no_nvcc(tmp_path, monkeypatch):
    cache = tmp_path / "real kill"
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(cache))
    monkeypatch.delenv("ATTNFORGE_NVCC", raising=False)
    proc = _build_in_subprocess(dict(os.environ))
    _wait_for(lambda: any("cicc" in line or "ptxas" in line for line in _mentioning(str(cache))), 120,
              "nvcc to reach cicc or ptxas")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    _wait_for(lambda: not _mentioning(str(cache)), 5, "every process of the killed build to exit")

    again = _build_in_subprocess(dict(os.environ))
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 0, output
    assert integrity.problem(library_path(SPEC)) is None and not list(module_dir(SPEC).glob("build.*"))


# --- damaged libraries (a real module) --------------------------------------------------------------

@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    """One real module, built once, in a cache whose path has a space."""
    cache = tmp_path_factory.mktemp("robust") / "cache with space"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNFORGE_CACHE_DIR", str(cache))
        patch.setenv("ATTNFORGE_CUDA_ARCH_LIST", "8.0")
        patch.delenv("ATTNFORGE_NVCC", raising=False)
        load_uncached(SPEC)
    return cache


@pytest.fixture
def cache_copy(real_cache, tmp_path, monkeypatch):
    """A copy of the real cache (ATTNFORGE_CACHE_DIR) and the pristine library's bytes."""
    copy = tmp_path / "cache copy"
    shutil.copytree(real_cache, copy)
    monkeypatch.setenv("ATTNFORGE_CACHE_DIR", str(copy))
    return copy


def _snapshot(folder: Path) -> dict:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in [folder, *folder.rglob("*")]}


def _make_read_only(cache: Path) -> None:
    """chmod -R a-w; root ignores permission bits, so there the lock file is replaced by a folder,
    which no process can open for writing (taking the lock is the first write of any rebuild)."""
    for path in [cache, *cache.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    if IS_ROOT:
        lock = build_module.lock_path(SPEC, settings())
        lock.unlink(missing_ok=True)
        lock.mkdir()


def _make_writable(cache: Path) -> None:
    for path in [cache, *cache.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)


def _load_in_subprocess() -> subprocess.CompletedProcess:
    """Load SPEC in a fresh interpreter, where a SIGBUS could not take the test run down with it."""
    code = textwrap.dedent("""
        import json, sys
        from attnforge.codegen.spec import KernelSpec
        from attnforge.loader import load_uncached
        module = load_uncached(KernelSpec.from_dict(json.loads(sys.argv[1])))
        print("loaded", sorted(module.fns))
    """)
    return subprocess.run([sys.executable, "-c", code, json.dumps(SPEC.to_dict())], capture_output=True,
                          text=True, timeout=300)


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 16]) + data[middle + 16:]


DAMAGE = {
    "truncated-4KiB": (lambda data: data[:4096], "it is truncated: 4096 bytes"),
    "truncated-half": (lambda data: data[: len(data) // 2], "it is truncated"),
    "empty": (lambda data: b"", "it is empty: 0 bytes"),
    "flipped-bytes": (_flip, "its sha256 differs"),
}


@pytest.mark.nvcc
def test_real_module_builds_in_a_path_with_a_space(real_cache):
    folder = real_cache / build_module.version() / SPEC.uri
    library = folder / f"{SPEC.uri}.so"
    assert " " in str(library) and integrity.problem(library) is None
    assert "$ " in (folder / "build" / "build.ninja").read_text()


@pytest.fixture
def relink_pristine(cache_copy, fake_nvcc, tmp_path, monkeypatch):
    """The stand-in compiler's link step yields the real module, so a rebuild loads for real."""
    pristine = tmp_path / "pristine.so"
    shutil.copyfile(library_path(SPEC), pristine)
    monkeypatch.setenv("FAKE_NVCC_LIBRARY", str(pristine))
    return pristine.read_bytes()


def _assert_rebuilt(result: subprocess.CompletedProcess, pristine: bytes, problem: str) -> None:
    assert result.returncode == 0, f"exit {result.returncode} (-7 is SIGBUS):\n{result.stdout}{result.stderr}"
    assert "loaded" in result.stdout
    assert problem in result.stderr and "rebuilding it" in result.stderr
    assert f"compiling {SPEC.uri} (rebuild)" in result.stderr
    assert library_path(SPEC).read_bytes() == pristine and integrity.problem(library_path(SPEC)) is None


@pytest.mark.nvcc
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_library_is_rebuilt_never_mapped(relink_pristine, damage):
    change, problem = DAMAGE[damage]
    library_path(SPEC).write_bytes(change(relink_pristine))
    _assert_rebuilt(_load_in_subprocess(), relink_pristine, problem)


@pytest.mark.nvcc
def test_library_without_record_is_rebuilt(relink_pristine):
    integrity.record_path(library_path(SPEC)).unlink()
    _assert_rebuilt(_load_in_subprocess(), relink_pristine, "it has no integrity record")


@pytest.mark.nvcc
def test_library_that_fails_dlopen_is_rebuilt(relink_pristine):
    library = library_path(SPEC)
    library.write_bytes(b"\x7fELF but not really a library" * 100)
    integrity.write_record(library)  # recorded, so only dlopen can tell
    _assert_rebuilt(_load_in_subprocess(), relink_pristine, "it does not load")


@pytest.mark.nvcc
def test_read_only_cache_of_valid_modules_loads_without_writing(cache_copy):
    build_module.lock_path(SPEC, settings()).unlink()  # as baked into an image: no lock file
    _make_read_only(cache_copy)
    before = _snapshot(cache_copy)
    try:
        module = load_uncached(SPEC)
    finally:
        _make_writable(cache_copy)
    assert module.path == library_path(SPEC)
    assert _snapshot(cache_copy) == before


@pytest.mark.nvcc
def test_read_only_damaged_cache_raises_one_clear_error(cache_copy):
    library = library_path(SPEC)
    library.write_bytes(library.read_bytes()[:4096])
    _make_read_only(cache_copy)
    before = _snapshot(cache_copy)
    try:
        with pytest.raises(CacheError) as raised:
            load_uncached(SPEC)
    finally:
        _make_writable(cache_copy)
    message = str(raised.value)
    assert str(library) in message and "truncated" in message
    assert f"Delete {module_dir(SPEC)}" in message and "ATTNFORGE_CACHE_DIR" in message
    assert _snapshot(cache_copy) == before


def test_verified_library_is_hashed_once_per_process(tmp_path, monkeypatch):
    library = tmp_path / "m.so"
    library.write_bytes(b"library bytes")
    integrity.write_record(library)
    hashed = []
    real = integrity.sha256
    monkeypatch.setattr(integrity, "sha256", lambda path: hashed.append(path) or real(path))
    assert integrity.problem(library) is None and integrity.problem(library) is None
    assert hashed == [library]
    library.write_bytes(b"library byteZ")  # same size, new content: checked again
    assert "sha256" in integrity.problem(library)
