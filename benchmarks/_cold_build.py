"""Cold builds of one module, each in a fresh Python process with an empty cache: ours (render + nvcc +
link through attnforge.build) and FlashInfer's JIT of the matching module (build_jit_specs into an
empty FLASHINFER_WORKSPACE_BASE). The time is the process's wall time, its start included, which is
what a serving engine pays on its first plan() for a new shape.

A build that fails gives a Timing with seconds None and the process's last lines; nothing here raises
for a failed or missing compiler or peer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import check
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind


@dataclass(frozen=True)
class Family:
    """One row of the cold-build table: a module kind and its FlashInfer counterpart, if any."""

    key: str  # the --families name
    label: str  # the table's module name, before its head dim
    kind: Kind
    backend: Backend
    dtype_qkv: DType
    flashinfer: str | None  # the key of FLASHINFER_MODULES built as its peer

    def spec(self, head_dim: int, arch: Arch) -> KernelSpec:
        return KernelSpec(kind=self.kind, backend=self.backend, dtype_q=self.dtype_qkv, dtype_kv=self.dtype_qkv,
                          dtype_o=DType.BF16, head_dim_qk=head_dim, head_dim_vo=head_dim, archs=(arch,))


FAMILIES = (
    Family("decode-fa2", "decode fa2 bf16", Kind.DECODE, Backend.FA2, DType.BF16, "decode"),
    Family("prefill-fa2", "prefill fa2 bf16", Kind.PREFILL, Backend.FA2, DType.BF16, "fa2"),
    Family("prefill-fa3", "prefill fa3 bf16", Kind.PREFILL, Backend.FA3, DType.BF16, "fa3"),
    Family("prefill-fa3-e4m3", "prefill fa3 e4m3 q/kv, bf16 o", Kind.PREFILL, Backend.FA3, DType.E4M3, None),
)
FAMILY_KEYS = tuple(f.key for f in FAMILIES)
# FlashInfer's JIT always targets this arch here: its FA3 module exists only for sm90a, and its
# times pair with our sm_90a rows.
FLASHINFER_ARCH = "9.0a"
TAIL_LINES = 15


@dataclass(frozen=True)
class Timing:
    seconds: float | None  # None: the build failed
    error: str = ""  # the process's last lines when it failed


def family(key: str) -> Family:
    return next(f for f in FAMILIES if f.key == key)


def refusal(spec: KernelSpec) -> str | None:
    """Why the rules refuse `spec` (each violated rule rendered), or None."""
    violations = check(spec)
    return "; ".join(rule.render(spec) for rule in violations) if violations else None


def _timed(code: str, args: list[str], env: dict[str, str]) -> Timing:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode == 0:
        return Timing(seconds)
    tail = (done.stdout + done.stderr).strip().splitlines()[-TAIL_LINES:]
    return Timing(None, f"exit {done.returncode}: " + "\n".join(tail))


_OURS = """
import json, sys
from attnforge.build import build
from attnforge.codegen.spec import KernelSpec
build(KernelSpec.from_dict(json.loads(sys.argv[1])))
"""


def ours(spec: KernelSpec) -> Timing:
    """Build `spec` into an empty cache in a fresh process (no prebuilt package is consulted)."""
    with tempfile.TemporaryDirectory(prefix="attnforge-cold-") as cache:
        env = {**os.environ, "ATTNFORGE_CACHE_DIR": cache, "ATTNFORGE_LOG_LEVEL": "WARNING"}
        return _timed(_OURS, [json.dumps(spec.to_dict())], env)


# FlashInfer 0.7.4's module generators, called as its own wrappers call them for bf16 q/kv/o, int32
# indices, no positional encoding, sliding window, soft cap or fp16 QK reduction.
_FLASHINFER = """
import sys
import torch
from flashinfer.jit.core import build_jit_specs
from flashinfer.jit.attention.modules import (gen_batch_decode_module, gen_batch_prefill_module,
                                              _gen_batch_prefill_primary_module)
which, head_dim = sys.argv[1], int(sys.argv[2])
bf16 = torch.bfloat16
tail = (torch.int32, head_dim, head_dim, 0, False, False)
make = {
    "decode": lambda: gen_batch_decode_module(bf16, bf16, bf16, *tail),
    "fa2": lambda: _gen_batch_prefill_primary_module("fa2", bf16, bf16, bf16, *tail, False, False),
    "fa3": lambda: gen_batch_prefill_module("fa3", bf16, bf16, bf16, *tail, False, False),
}
build_jit_specs([make[which]()], verbose=False)
"""
FLASHINFER_MODULES = ("decode", "fa2", "fa3")


def _flashinfer_env(workspace: str) -> dict[str, str]:
    return {**os.environ, "FLASHINFER_WORKSPACE_BASE": workspace, "FLASHINFER_CUDA_ARCH_LIST": FLASHINFER_ARCH,
            "FLASHINFER_DISABLE_VERSION_CHECK": "1"}


def flashinfer_version() -> tuple[str | None, str]:
    """(FlashInfer's version, "") when a fresh process imports it, else (None, why not)."""
    with tempfile.TemporaryDirectory(prefix="flashinfer-probe-") as workspace:
        done = subprocess.run([sys.executable, "-c", "import flashinfer; print(flashinfer.__version__)"],
                              env=_flashinfer_env(workspace), capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.strip().splitlines()[-1], ""
    last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return None, f"flashinfer is not importable ({last})"


def flashinfer(which: str, head_dim: int) -> Timing:
    """FlashInfer's cold JIT build of one module (`which` in FLASHINFER_MODULES) in a fresh process."""
    if which not in FLASHINFER_MODULES:
        raise ValueError(f"which: expected one of {', '.join(FLASHINFER_MODULES)}, got {which!r}")
    with tempfile.TemporaryDirectory(prefix="flashinfer-cold-") as workspace:
        return _timed(_FLASHINFER, [which, str(head_dim)], _flashinfer_env(workspace))
