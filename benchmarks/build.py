"""Cold build time of a decode module: render, nvcc and link into an empty cache, in a fresh
process (what a serving engine pays on its first plan() for a new shape)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="attnforge bench build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
    parser.add_argument("--arch", nargs="+", default=["90a"], help="compile targets, e.g. 80 90a")
    args = parser.parse_args(argv)
    print("| module | arch | cold build (s), incl. process start |")
    print("|---|---|---|")
    for head_dim in args.head_dim:
        for arch in args.arch:
            print(f"| decode fa2 bf16 hd{head_dim} | sm_{arch} | {cold_build_seconds(head_dim, arch):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
