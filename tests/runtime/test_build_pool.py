"""The compiler budget of `attnforge build`: cores (or MAX_JOBS) and memory, shared by the concurrent builds
through one jobserver (or split evenly with an older ninja); the longest modules start first."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from attnforge import build_pool
from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind
from attnforge.settings import settings

GB = 2**30


@pytest.mark.parametrize("cores, memory, max_jobs, parallel, expected", [
    (16, 128 * GB, None, 4, 4),  # cores split evenly
    (16, 128 * GB, None, 3, 5),  # rounded down
    (16, 128 * GB, None, 32, 1),  # never below one
    (16, 6 * GB, None, 2, 2),  # memory holds 4 nvcc: 2 each
    (16, 128 * GB, 8, 2, 4),  # MAX_JOBS is the budget instead of the cores
    (2, None, None, 1, 2),  # memory unknown: cores only
])
def test_jobs_per_build(cores, memory, max_jobs, parallel, expected, monkeypatch):
    monkeypatch.setattr(build_pool, "cpu_count", lambda: cores)
    monkeypatch.setattr(build_pool, "memory_bytes", lambda: memory)
    config = dataclasses.replace(settings(), max_jobs=max_jobs)
    assert build_pool.jobs_per_build(parallel, config) == expected


def test_memory_and_cores_are_read_from_the_host():
    assert build_pool.cpu_count() >= 1
    assert build_pool.memory_bytes() > 256 * 2**20


def _spec(kind=Kind.DECODE, backend=Backend.FA2, dtype=DType.BF16, head_dim=128, arch=Arch.SM80) -> KernelSpec:
    return KernelSpec(kind=kind, backend=backend, dtype_q=dtype, dtype_kv=dtype,
                      dtype_o=DType.BF16 if dtype.is_fp8 else dtype, head_dim_qk=head_dim, head_dim_vo=head_dim,
                      archs=(arch,))


def test_longest_first_starts_fa3_then_fp8_then_large_head_dims():
    decode = _spec()
    fa2 = _spec(kind=Kind.PREFILL, head_dim=256)
    fa3 = _spec(kind=Kind.PREFILL, backend=Backend.FA3, arch=Arch.SM90A)
    fa3_fp8 = _spec(kind=Kind.PREFILL, backend=Backend.FA3, dtype=DType.E4M3, head_dim=64, arch=Arch.SM90A)
    assert build_pool.longest_first([decode, fa2, fa3, fa3_fp8]) == [fa3_fp8, fa3, fa2, decode]


def test_jobserver_fifo_holds_the_tokens():
    with build_pool.jobserver(3) as makeflags:
        assert makeflags.startswith("-j4 --jobserver-auth=fifo:")
        path = makeflags.split("fifo:", 1)[1]
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            assert os.read(fd, 16) == b"+++"
        finally:
            os.close(fd)
    assert not os.path.exists(path)


# A stand-in nvcc that appends "start end" (perf counter) lines to TIMED_NVCC_LOG around a short sleep.
TIMED_NVCC = f"""#!{sys.executable}
import os, shutil, sys, time
args = sys.argv[1:]
started = time.time()
time.sleep(0.4)
out = args[args.index("-o") + 1]
if "-MF" in args:
    open(args[args.index("-MF") + 1], "w").write(out + ":\\n")
if "-shared" in args:
    shutil.copyfile(os.environ["TIMED_NVCC_LIBRARY"], out)
else:
    open(out, "w").write("object\\n")
with open(os.environ["TIMED_NVCC_LOG"], "a") as log:
    log.write(f"{{started}} {{time.time()}}\\n")
"""


def _most_at_once(log) -> int:
    events = []
    for line in log.read_text().splitlines():
        start, end = map(float, line.split())
        events += [(start, 1), (end, -1)]
    running = most = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        running += step
        most = max(most, running)
    return most


@pytest.mark.skipif(not build_pool.ninja_joins_jobservers(), reason="ninja older than 1.13 (no jobserver client)")
@pytest.mark.parametrize("budget, parallel, specs", [(3, 2, 2), (2, 2, 3)])
def test_concurrent_builds_share_the_compiler_budget(tmp_path, monkeypatch, budget, parallel, specs):
    """The ninjas take their slots from the shared jobserver: compilers at once never exceed the budget
    (MAX_JOBS), and two builds sharing three slots reach three at once (an even split gives each one)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(TIMED_NVCC)
    nvcc.chmod(0o755)
    (tmp_path / "fake.so").write_bytes(b"library\n")
    monkeypatch.setenv("TIMED_NVCC_LIBRARY", str(tmp_path / "fake.so"))
    monkeypatch.setenv("TIMED_NVCC_LOG", str(tmp_path / "times.log"))
    monkeypatch.setattr(build_pool, "memory_bytes", lambda: None)
    config = dataclasses.replace(settings(), cache_dir=tmp_path / "cache", nvcc=str(nvcc), max_jobs=budget)
    chosen = [_spec(head_dim=d) for d in (64, 128, 256)[:specs]]
    outcomes = build_pool.build_all(chosen, parallel, config)
    assert [o.status for o in outcomes] == ["built"] * specs, [o.error for o in outcomes]
    assert _most_at_once(tmp_path / "times.log") == budget
