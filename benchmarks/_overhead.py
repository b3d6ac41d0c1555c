"""run()'s host overhead: what a serving engine pays per eager call on top of the kernel.

A batch-1 decode kernel takes a few µs, so back-to-back eager calls are bound by the host: their
per-call time minus that of replaying the same call from a CUDA graph (the kernel alone, launched
without Python) is the host time run() adds. Also reported: the host time of one call measured on
the CPU clock (the calls are asynchronous; the queue never fills at this count).

Each library is measured in a process of its own (`python -m attnforge.benchmarks._overhead LIBRARY
LAYOUT`, one JSON row per decode path on stdout): importing FlashInfer into a process was measured to
slow attnforge's run() loops there by 5 µs per call (13.0 -> 18.2 µs of overhead, H200 host).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ._timing import graph_of, settle

CALLS = 200
REPEATS = 7  # the median of this many loops of CALLS calls


@dataclass
class Overhead:
    eager_us: float  # per call, back to back, CUDA events around the loop
    graph_us: float  # per replay of a graph holding one call
    host_us: float  # per call, the CPU clock around the loop (no synchronize inside)

    @property
    def overhead_us(self) -> float:
        return self.eager_us - self.graph_us


def _loop_us(fn, calls: int) -> tuple[float, float]:
    """(GPU-clock µs, CPU-clock µs) per call over `calls` back-to-back calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return 1000.0 * start.elapsed_time(end) / calls, 1e6 * host / calls


def measure(call) -> Overhead:
    """call(): one run() on static buffers (capturable). Times it eager, then from a CUDA graph."""
    settle(call, 20)
    eager, host = zip(*(_loop_us(call, CALLS) for _ in range(REPEATS)))
    graph = graph_of(call)
    settle(graph.replay, 20)
    replay = [_loop_us(graph.replay, CALLS)[0] for _ in range(REPEATS)]
    return Overhead(statistics.median(eager), statistics.median(replay), statistics.median(host))


def in_own_process(library: str, layout: str) -> list[dict]:
    """Both decode paths' Overhead for `library` ("attnforge" or "flashinfer"), measured in a child
    process that imports only that library."""
    done = subprocess.run([sys.executable, "-m", "attnforge.benchmarks._overhead", library, layout],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{library} overhead measurement failed:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(library: str, layout: str) -> None:
    import importlib

    from . import decode

    module = importlib.import_module(library)
    problem = decode.make_problem(1, decode.OVERHEAD_KV_LEN, layout)
    for tensor_cores in (False, True):
        workspace = torch.empty(decode.OVERHEAD_WORKSPACE, dtype=torch.uint8, device="cuda")
        call, _ = decode.decode_call(module, problem, layout, workspace, tensor_cores)
        found = measure(call)
        print(json.dumps(dict(tensor_cores=tensor_cores, **asdict(found))), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
