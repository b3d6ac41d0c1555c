"""`attnforge build` of a whole manifest into an empty cache, in a fresh process, as a user runs it; the
per-module seconds and sizes are read back from the closing table it prints
(attnforge.build_pool.summary_table), the wall time is the process's, its start included."""

from __future__ import annotations

import contextlib
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_HEADER = re.compile(r"module\s+seconds\s+size")
_ROW = re.compile(r"(?P<module>\S+)\s+(?P<seconds>[0-9.]+|cached|FAILED)\s+(?P<size>[0-9.]+ MiB|-)")
_TOTAL = re.compile(r"(?P<built>\d+) built, (?P<cached>\d+) cached, (?P<failed>\d+) failed in (?P<seconds>[0-9.]+) s")
TAIL_LINES = 30


class TableError(ValueError):
    """`attnforge build`'s output holds no closing table this parser understands."""


@dataclass(frozen=True)
class ManifestBuild:
    modules: list[dict]  # one row per module: module (uri), status, seconds, size_mib
    counts: dict[str, int]  # built, cached, failed (all 0 when there is no table)
    build_s: float  # the command's own total, from its table
    wall_s: float  # the process's wall time
    cpu_s: float  # user + system CPU time of the process and every compiler it ran
    exit_code: int
    error: str  # the command's last lines when it failed or printed no table


def parse_table(output: str) -> tuple[list[dict], dict[str, int], float]:
    """The rows, counts and total seconds of the last closing table in `output`."""
    lines = [line.strip() for line in output.splitlines()]
    starts = [i for i, line in enumerate(lines) if _HEADER.fullmatch(line)]
    if not starts:
        raise TableError("no closing table (a 'module  seconds  size' header) in attnforge build's output")
    rows = []
    for line in lines[starts[-1] + 1:]:
        total = _TOTAL.fullmatch(line)
        if total:
            counts = {key: int(total[key]) for key in ("built", "cached", "failed")}
            return rows, counts, float(total["seconds"])
        row = _ROW.fullmatch(line)
        if row is None:
            raise TableError(f"a line of attnforge build's table is not 'module seconds size': {line!r}")
        seconds, size = row["seconds"], row["size"]
        rows.append(dict(module=row["module"],
                         status={"cached": "cached", "FAILED": "failed"}.get(seconds, "built"),
                         seconds=float(seconds) if seconds not in ("cached", "FAILED") else None,
                         size_mib=float(size.split()[0]) if size != "-" else None))
    raise TableError("attnforge build's table has no closing 'N built, N cached, N failed in S s' line")


def command(manifest: Path | None, archs: list[str], parallel: int, cache: str) -> list[str]:
    """The `attnforge build` command line (as `python -m`, so that it is this interpreter's attnforge)."""
    given = ["--manifest", str(manifest)] if manifest else []
    return [sys.executable, "-m", "attnforge.codegen.cli", "build", *given,
            *(arg for arch in archs for arg in ("--arch", arch)), "-j", str(parallel), "--cache-dir", cache]


def build(manifest: Path | None, archs: list[str], parallel: int, keep: Path | None = None) -> ManifestBuild:
    """Run `attnforge build` of `manifest` (None: the packaged default) for `archs` into an empty cache:
    a temporary one, or `keep` (new or empty), left in place for later use."""
    with contextlib.ExitStack() as stack:
        if keep is None:
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="attnforge-manifest-"))
        else:
            keep.mkdir(parents=True, exist_ok=True)  # new or empty: build.py's options check it
            cache = str(keep)
        started, before = time.perf_counter(), _children_cpu_s()
        done = subprocess.run(command(manifest, archs, parallel, cache), capture_output=True, text=True)
        wall, cpu = time.perf_counter() - started, _children_cpu_s() - before
    tail = "\n".join((done.stderr.strip() or done.stdout.strip()).splitlines()[-TAIL_LINES:])
    try:
        rows, counts, seconds = parse_table(done.stdout)
    except TableError as exc:
        counts = dict(built=0, cached=0, failed=0)
        return ManifestBuild([], counts, float("nan"), wall, cpu, done.returncode,
                             f"{exc}; exit {done.returncode}\n{tail}")
    return ManifestBuild(rows, counts, seconds, wall, cpu, done.returncode, tail if done.returncode else "")


def _children_cpu_s() -> float:
    """CPU seconds of the finished descendants (each process's own time counts once it is reaped, and
    ninja reaps its compilers): the work the build did, whatever its parallelism."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
