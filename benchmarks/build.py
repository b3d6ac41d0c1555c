"""Cold build time of a decode module: render, nvcc and link into an empty cache, in a fresh
process (what a serving engine pays on its first plan() for a new shape)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from . import _record

_BUILD = """
from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind
from attnforge.loader import load_uncached
spec = KernelSpec(kind=Kind.DECODE, backend=Backend.FA2, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                  dtype_o=DType.BF16, head_dim_qk={hd}, head_dim_vo={hd}, archs=(Arch.parse("{arch}"),))
load_uncached(spec)
"""


def cold_build_seconds(head_dim: int, arch: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "ATTNFORGE_CACHE_DIR": cache, "ATTNFORGE_LOG_LEVEL": "WARNING"}
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", _BUILD.format(hd=head_dim, arch=arch)], env=env, check=True)
        return time.perf_counter() - started


def nvcc_version() -> str:
    """nvcc's release line ("Cuda compilation tools, release 13.0, V13.0.88"), or "unknown"."""
    from attnforge.settings import settings

    nvcc = settings().nvcc
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30) if nvcc else None
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = done.stdout.strip().splitlines() if done and done.returncode == 0 else []
    return next((line for line in lines if "release" in line), lines[-1] if lines else "unknown")


def config() -> dict:
    """What the JSON record says about the builds."""
    return dict(what="render + nvcc + link into an empty cache, in a fresh process (its start included)",
                cpu_count=os.cpu_count(), nvcc=nvcc_version())


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="attnforge bench build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
    parser.add_argument("--arch", nargs="+", default=["90a"], help="compile targets, e.g. 80 90a")
    _record.add_out_option(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print("| module | arch | cold build (s), incl. process start |")
    print("|---|---|---|")
    rows = []
    for head_dim in args.head_dim:
        for arch in args.arch:
            row = dict(module=f"decode fa2 bf16 hd{head_dim}", kind="decode", backend="fa2", dtype="bf16",
                       head_dim=head_dim, arch=f"sm_{arch}", cold_build_s=cold_build_seconds(head_dim, arch))
            rows.append(row)
            print(f"| {row['module']} | {row['arch']} | {row['cold_build_s']:.1f} |")
    if args.out:
        _record.write(args.out, "build", argv, config(), tables=dict(build=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
