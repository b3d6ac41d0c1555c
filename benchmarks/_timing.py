"""Timing shared by the benchmarks: CUDA events per eager call or per replay of a CUDA graph of calls, and
the copy bandwidth ceiling."""

from __future__ import annotations

import statistics
import time

import torch

# The H200 runs heavy kernels at its 700 W power cap: its clock starts at 1980 MHz and the power
# limiter brings it to 1650-1740 MHz within about 100 ms of sustained load. A timing that starts
# from idle therefore reads up to 15% fast for its first ~60 ms, and two kernels timed after
# different idle gaps are not comparable. Every kernel is warmed up for this long first, so that
# each is timed at the clock it sustains (what a serving engine gets).
SETTLE_SECONDS = 0.5


def settle(fn, calls: int, seconds: float = SETTLE_SECONDS) -> None:
    """Run fn() at least `calls` times and for at least `seconds` of back-to-back launches."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    batch = max(calls, 1)
    while time.perf_counter() - started < seconds:
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()


def time_cuda_us(fn, iters: int, warmup: int, flush=None) -> float:
    """Median microseconds of fn() measured by CUDA events around each call, after `settle`."""
    settle(fn, warmup)
    events = []
    for _ in range(iters):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return 1000.0 * statistics.median(s.elapsed_time(e) for s, e in events)


def graph_of(run, runs: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `runs` back-to-back run() calls, captured after one warm-up call off the
    default stream (as torch.cuda.graph expects)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(runs):
            run()
    return graph


def time_graph_us(run, runs: int, iters: int, warmup: int, flush=None) -> float:
    """Median microseconds per run() inside a CUDA graph of `runs` back-to-back run() calls (graph_of):
    the replays settle first, then CUDA events around each of `iters` replays (flush, when given, runs
    before each replay, outside the events: only the first run of a replay starts from a flushed L2);
    the median replay divided by `runs`. What the capture raises propagates; the graph is freed on return."""
    graph = graph_of(run, runs)
    return time_cuda_us(graph.replay, iters, warmup, flush) / runs


def copy_bandwidth_gbps(total_bytes: int = 4 << 30) -> float:
    """Device-to-device copy of total_bytes, counted as read + write."""
    src = torch.empty(total_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    us = time_cuda_us(copy, iters=20, warmup=3)
    return 2 * total_bytes / (us * 1e3)  # both buffers are freed on return
