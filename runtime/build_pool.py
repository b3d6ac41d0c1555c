"""Build many modules ahead of use (`attnforge build`): several module builds at once, the cores split
among them, modules already in the cache skipped. Returns one Outcome per spec; never raises for a
module that fails to compile (its compiler tail is in the outcome)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from attnforge.codegen.spec import KernelSpec

from . import integrity
from .build import BuildError, build, library_path
from .settings import Settings

# Peak resident memory of one nvcc on an FA3 unit; bounds the number of compilers a host can run.
BYTES_PER_NVCC = int(1.5 * 2**30)


@dataclass(frozen=True)
class Outcome:
    spec: KernelSpec
    library: Path | None
    seconds: float | None  # None: found in the cache, not built
    error: str | None = None

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return "cached" if self.seconds is None else "built"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def default_parallel() -> int:
    """Module builds at once: one per four cores, since a module has several units ninja runs in parallel."""
    return max(1, cpu_count() // 4)


def jobs_per_build(parallel: int, config: Settings) -> int:
    """Each ninja's -j: the host's compiler budget (MAX_JOBS, else the cores, at most what memory
    holds) split evenly among the concurrent builds, at least one."""
    budget = config.max_jobs or cpu_count()
    memory = memory_bytes()
    if memory:
        budget = min(budget, max(1, memory // BYTES_PER_NVCC))
    return max(1, budget // max(1, parallel))


def build_all(specs: Sequence[KernelSpec], parallel: int, config: Settings,
              on_done: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Build every spec not in the cache, `parallel` at a time; outcomes come back in the specs' order."""
    outcomes = {}
    todo = []
    for spec in specs:
        library = library_path(spec, config)
        if integrity.problem(library) is None:  # a damaged library is built again
            outcomes[spec] = Outcome(spec, library, None)
            on_done(outcomes[spec])
        else:
            todo.append(spec)
    if todo:
        workers = min(parallel, len(todo))
        share = dataclasses.replace(config, max_jobs=jobs_per_build(workers, config))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for future in as_completed([pool.submit(_build_one, spec, share) for spec in todo]):
                outcome = future.result()
                outcomes[outcome.spec] = outcome
                on_done(outcome)
    return [outcomes[spec] for spec in specs]


def _build_one(spec: KernelSpec, config: Settings) -> Outcome:
    started = time.perf_counter()
    try:
        library = build(spec, config)
    except (BuildError, OSError) as exc:
        return Outcome(spec, None, time.perf_counter() - started, error=str(exc))
    return Outcome(spec, library, time.perf_counter() - started)


def summary_table(outcomes: Sequence[Outcome], wall_seconds: float) -> str:
    """One row per module: uri, seconds (or cached / FAILED) and the library's size; then the totals."""
    rows = [("module", "seconds", "size")]
    for outcome in outcomes:
        if outcome.status == "failed":
            rows.append((outcome.spec.uri, "FAILED", "-"))
            continue
        seconds = "cached" if outcome.seconds is None else f"{outcome.seconds:.1f}"
        rows.append((outcome.spec.uri, seconds, f"{outcome.library.stat().st_size / 2**20:.1f} MiB"))
    width = max(len(row[0]) for row in rows)
    lines = [f"{uri:<{width}}  {seconds:>8}  {size:>10}" for uri, seconds, size in rows]
    counts = {status: sum(o.status == status for o in outcomes) for status in ("built", "cached", "failed")}
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()) + f" in {wall_seconds:.1f} s")
    return "\n".join(lines)
