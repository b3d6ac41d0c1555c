"""`.ci/gpu-session`'s own checks of its knobs, run where there is no GPU: with GPU_SESSION_INSTALL=0
it installs nothing, so a bad TEST_JOBS is refused before any pytest process starts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "gpu-session"


@pytest.mark.parametrize("jobs", ["abc", "0", "-2", "1.5"])
def test_test_jobs_must_be_a_positive_count(tmp_path, jobs):
    env = dict(os.environ, GPU_SESSION_INSTALL="0", OUT=str(tmp_path), TEST_JOBS=jobs)
    result = subprocess.run(["bash", str(SCRIPT), "tests"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"TEST_JOBS: expected a positive number of pytest processes, got '{jobs}'" in result.stdout
    assert not list(tmp_path.glob("gpu-tests*.log")), "no pytest process may start"


def test_unknown_step_is_named(tmp_path):
    env = dict(os.environ, GPU_SESSION_INSTALL="0", OUT=str(tmp_path))
    result = subprocess.run(["bash", str(SCRIPT), "benchmark"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown step benchmark (expected peers, tests, bench, prebuilt, sanitize)" in result.stdout
