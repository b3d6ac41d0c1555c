"""The JSON record every benchmark writes with --out: one header naming the run, then the benchmark's
config and its tables (lists of rows, one dict per table row). `attnforge bench report` renders
docs/benchmarks.md from these files alone, so a field the docs show must be in a row here.

Field names carry their unit as a suffix (UNITS); None is a value not measured (a refusing peer), NaN
a measured one that is not a number (Python's json reads it back)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

SCHEMA = 1
# The commit to record when the sources are not a git checkout (an installed copy on the device);
# read only here.
COMMIT_ENV = "ATTNFORGE_COMMIT"
UNITS = {
    "us": "microseconds per call, median over CUDA-event timings after the warm-up",
    "tflops": "TFLOP/s, 4 * B * L^2 * Hq * D per call, halved for causal",
    "gbps": "GB/s, the bytes a call must move once (q + K + V + o)",
    "pct_copy_bw": "percent of this run's device-to-device copy bandwidth",
    "s": "seconds of wall time",
    "rel_l2": "relative L2 error, |out - ref| / |ref|",
    "max_abs": "largest absolute error",
}


def add_out_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE.json",
                        help="also write the run as JSON (header, config, tables) for `attnforge bench report`")


def _git_commit() -> str | None:
    """HEAD of the checkout these sources are in (an editable install), or None."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and sha else None


def commit() -> str:
    return _git_commit() or os.environ.get(COMMIT_ENV, "").strip() or "unknown"


def gpu_name() -> str:
    """torch's name for device 0, else nvidia-smi's, else "none"."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "none"
    names = done.stdout.strip().splitlines()
    return names[0].strip() if done.returncode == 0 and names else "none"


def _version() -> str:
    try:
        return metadata.version("attnforge")
    except metadata.PackageNotFoundError:
        return "unknown"


def header(benchmark: str, argv: list[str] | None = None) -> dict:
    import torch

    return dict(
        schema=SCHEMA,
        benchmark=benchmark,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        gpu=gpu_name(),
        commit=commit(),
        attnforge_version=_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda or "none",
        argv=list(sys.argv[1:] if argv is None else argv),
        units=UNITS,
    )


def write(path: str, benchmark: str, argv: list[str] | None, config: dict, tables: dict[str, list[dict]],
          **extra) -> None:
    """header + config + extra top-level values + tables, written atomically (temp file, rename)."""
    record = {**header(benchmark, argv), "config": config, **extra, "tables": tables}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(temp, target)
