"""Timing shared by the benchmarks: CUDA events per call, and the copy bandwidth ceiling."""

from __future__ import annotations

import statistics

import torch


def time_cuda_us(fn, iters: int, warmup: int, flush=None) -> float:
    """Median microseconds of fn() measured by CUDA events around each call."""
    for _ in range(warmup):
        fn()
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


def copy_bandwidth_gbps(total_bytes: int = 4 << 30) -> float:
    """Device-to-device copy of total_bytes, counted as read + write."""
    src = torch.empty(total_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_cuda_us(lambda: dst.copy_(src), iters=20, warmup=3)
    del src, dst
    return 2 * total_bytes / (us * 1e3)
