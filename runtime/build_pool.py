"""Build many modules ahead of use (`attnforge build`): several module builds at once, modules already
in the cache skipped. Returns one Outcome per spec; never raises for a module that fails to compile
(its compiler tail is in the outcome).

The concurrent ninjas share the compiler budget through one GNU make jobserver (a FIFO of tokens,
which ninja 1.13+ joins when MAKEFLAGS names it), so a module whose units are done frees its slots
for the others instead of leaving its share of the cores idle; the most expensive modules start
first, so the last to finish are the short ones. An older ninja gets a static -j share instead."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from attnforge.codegen.spec import Backend, KernelSpec

from . import integrity
from .build import BuildError, build, library_path, ninja_joins_jobservers
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
    """Module builds at once: one per two cores. Each holds one compiler slot of its own and takes
    more from the shared jobserver, so half the budget stays free for the modules with many units."""
    return max(1, cpu_count() // 2)


def compiler_budget(config: Settings) -> int:
    """nvcc processes at once: MAX_JOBS, else the cores, at most what memory holds."""
    budget = config.max_jobs or cpu_count()
    memory = memory_bytes()
    if memory:
        budget = min(budget, max(1, memory // BYTES_PER_NVCC))
    return budget


def jobs_per_build(parallel: int, config: Settings) -> int:
    """Each ninja's -j without a jobserver: the compiler budget split evenly among the concurrent
    builds, at least one."""
    return max(1, compiler_budget(config) // max(1, parallel))


def longest_first(specs: Sequence[KernelSpec]) -> list[KernelSpec]:
    """Specs in the order to start them: fa3 (several wgmma units of 10-20 s) before fa2, fp8 before
    16-bit, larger head dims first; a build order that ends on short modules keeps every core busy."""
    return sorted(specs, key=lambda spec: (spec.backend is Backend.FA3, spec.dtype_q.is_fp8 or spec.dtype_kv.is_fp8,
                                           spec.head_dim_qk), reverse=True)


@contextlib.contextmanager
def jobserver(tokens: int):
    """A GNU make jobserver: a FIFO holding `tokens` tokens. Yields the MAKEFLAGS that names it; each
    client runs one job on its own and one more per token it holds."""
    with tempfile.TemporaryDirectory(prefix="attnforge-jobserver.") as folder:
        path = os.path.join(folder, "fifo")
        os.mkfifo(path, 0o600)
        # Held open for the whole build: a FIFO with no open end loses its tokens.
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        try:
            os.write(fd, b"+" * tokens)
            yield f"-j{tokens + 1} --jobserver-auth=fifo:{path}"
        finally:
            os.close(fd)


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
        with contextlib.ExitStack() as stack:
            shared = None
            if ninja_joins_jobservers():
                shared = stack.enter_context(jobserver(max(0, compiler_budget(config) - workers)))
            else:
                config = dataclasses.replace(config, max_jobs=jobs_per_build(workers, config))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                futures = [pool.submit(_build_one, spec, config, shared) for spec in longest_first(todo)]
                for future in as_completed(futures):
                    outcome = future.result()
                    outcomes[outcome.spec] = outcome
                    on_done(outcome)
    return [outcomes[spec] for spec in specs]


def _build_one(spec: KernelSpec, config: Settings, jobserver: str | None) -> Outcome:
    started = time.perf_counter()
    try:
        library = build(spec, config, jobserver=jobserver)
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
