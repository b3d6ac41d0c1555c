"""The compiler budget of `attnforge build`: cores (or MAX_JOBS) and memory split among concurrent builds."""

from __future__ import annotations

import dataclasses

import pytest

from attnforge import build_pool
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
