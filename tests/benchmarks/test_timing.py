"""The benchmarks' timers without a GPU: fake CUDA events on a fake clock that the timed calls advance,
so the medians and the per-run division are checked exactly (CPU)."""

from __future__ import annotations

import pytest
import torch

from attnforge.benchmarks import _timing


class Clock:
    """A fake GPU clock in ms: each timed call advances it by the next of `durations` (then the last again)."""

    def __init__(self, durations: list[float]):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def tick(self) -> None:
        self.calls += 1
        self.now += self.durations.pop(0) if len(self.durations) > 1 else self.durations[0]

    def event(self):
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = outer.now

            def elapsed_time(self, end) -> float:
                return end.at - self.at

        return Event


def fake_cuda(monkeypatch, clock: Clock) -> None:
    monkeypatch.setattr(torch.cuda, "Event", clock.event())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(_timing, "settle", lambda fn, calls, seconds=0.0: [fn() for _ in range(calls)])


def test_time_cuda_us_is_the_median_of_the_calls_in_us(monkeypatch):
    clock = Clock([9.0, 0.010, 0.030, 0.020])  # the warm-up call first, then three timed calls
    fake_cuda(monkeypatch, clock)
    assert abs(_timing.time_cuda_us(clock.tick, iters=3, warmup=1) - 20.0) < 1e-9


def test_time_graph_us_times_replays_of_one_graph_and_divides_by_its_runs(monkeypatch):
    captured = []

    class Graph:
        def __init__(self, run, runs):
            self.run, self.runs = run, runs

        def replay(self):
            for _ in range(self.runs):
                self.run()

    def graph_of(run, runs=1):
        captured.append(runs)
        return Graph(run, runs)

    clock = Clock([0.010])  # 10 µs per run
    fake_cuda(monkeypatch, clock)
    monkeypatch.setattr(_timing, "graph_of", graph_of)
    flushes = []
    us = _timing.time_graph_us(clock.tick, runs=8, iters=5, warmup=2, flush=lambda: flushes.append(clock.now))
    assert captured == [8] and abs(us - 10.0) < 1e-9
    assert clock.calls == 8 * (2 + 5) and len(flushes) == 5  # warm-up replays, then the timed ones


def test_a_failing_capture_propagates(monkeypatch):
    def graph_of(run, runs=1):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_timing, "graph_of", graph_of)
    with pytest.raises(RuntimeError, match="capturing"):
        _timing.time_graph_us(lambda: None, 4, 1, 1)
