"""FlashInfer as a same-run peer of the prefill, decode and fp8 benchmarks.

attnforge's wrappers take FlashInfer's calling conventions, so each benchmark builds its calls with one
function that takes the library as an argument: the peer gets the same tensors, the same plan()/run()
arguments and the same timer, in the same process. This module holds what is FlashInfer's alone:
importing it (or saying why not), the first call of each of its modules before anything is timed
(FlashInfer JIT-compiles a module on first use: tens of seconds each), and a peer call that raises
(an unsupported combination, a failed build) turned into a table cell of n/a plus a note, never an
error. A module that failed once is not tried again in the run: a JIT failure would recompile each time.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

NO_FLASHINFER = "not run (--no-flashinfer)"
# The head dims the peer is timed at: those FlashInfer ships prebuilt kernels for. At another dim its
# first call would JIT-compile a module per path (a minute or more each), so those cells are n/a.
HEAD_DIMS = (64, 128, 256)


class PeerModule(NamedTuple):
    """One FlashInfer JIT module: `kind` picks its generator ("decode": CUDA-core batch decode, "fa2": the
    fa2 prefill module, which also serves its tensor-core decode, "fa3"); dtypes by torch name."""

    kind: str
    dtype_q: str
    dtype_kv: str
    head_dim: int


def timed_modules(fp8_head_dims) -> list[PeerModule]:
    """Every FlashInfer attention module the decode, prefill and fp8 benchmarks call with their
    defaults (the peer test's bf16 hd 128 ones among them): bf16 on each path at HEAD_DIMS; the fp8
    paths (e4m3 q/k/v on fa3, an e4m3 cache under a bf16 query on fa2) at fp8_head_dims, and fp8-KV
    CUDA-core decode at hd 128 (the fp8 benchmark's decode table). Outputs are bf16 throughout."""
    bf16 = [PeerModule(kind, "bfloat16", "bfloat16", dim) for dim in HEAD_DIMS for kind in ("decode", "fa2", "fa3")]
    fp8 = [PeerModule("decode", "bfloat16", "float8_e4m3fn", 128)]
    fp8 += [m for dim in fp8_head_dims for m in (PeerModule("fa2", "bfloat16", "float8_e4m3fn", dim),
                                                    PeerModule("fa3", "float8_e4m3fn", "float8_e4m3fn", dim))]
    return bf16 + fp8


def prebuild(modules: list[PeerModule]) -> None:
    """Builds the modules side by side, each by its own ninja run in its own build folder, into
    FlashInfer's cache: a first call then finds its module up to date instead of compiling it alone
    (15-100 s each, one after another). Not build_jit_specs' single ninja run: its dependency records
    stay in the cache's top folder, so the first call's ninja, run in the module's folder, finds none
    and compiles again. Modules FlashInfer ships prebuilt (AOT) are skipped: they load as they are."""
    from flashinfer.jit.attention import modules as jit

    specs = []
    for m in modules:
        dtypes = (getattr(torch, m.dtype_q), getattr(torch, m.dtype_kv), torch.bfloat16, torch.int32)
        tail = (m.head_dim, m.head_dim, 0, False, False)  # head dims qk/vo, no RoPE, no window, no soft cap
        if m.kind == "decode":
            specs.append(jit.gen_batch_decode_module(*dtypes, *tail))
        elif m.kind == "fa2":  # what its fa2 wrappers load (the module's private name in 0.7.4)
            specs.append(jit._gen_batch_prefill_primary_module("fa2", *dtypes, *tail, False))
        else:
            specs.append(jit.gen_batch_prefill_module("fa3", *dtypes, *tail, False))
    todo = [spec for spec in specs if not spec.is_aot]
    if todo:
        with ThreadPoolExecutor(max_workers=len(todo)) as pool:
            list(pool.map(lambda spec: spec.build(verbose=False, need_lock=True), todo))  # raises a failed build's error


def skip_note(head_dim: int, timed=HEAD_DIMS) -> str:
    """Why the peer is not timed at head_dim (it is at the `timed` dims), or "" where it is."""
    if head_dim in timed:
        return ""
    return f"FlashInfer not run at hd {head_dim} (timed at hd {', '.join(map(str, timed))} only)"


def timed_peer(peer, head_dim: int, notes: list, timed=HEAD_DIMS):
    """The peer where it is timed at head_dim, else None and skip_note's reason in notes (a present
    peer only: an absent one's reason is the run's)."""
    if peer is not None and peer.present and (skipped := skip_note(head_dim, timed)):
        notes.append(skipped)
        return None
    return peer


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-flashinfer", action="store_true",
                        help="skip the FlashInfer peer (used when it is importable)")


def flashinfer_or_reason():
    """(the flashinfer module, "") when the peer imports, else (None, why)."""
    try:
        import flashinfer
    except Exception as exc:  # a broken install is as absent as a missing one
        return None, f"FlashInfer not importable ({type(exc).__name__}: {exc})"
    return flashinfer, ""


def reason(exc: BaseException) -> str:
    """An exception as one short line of a table's notes."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:120] if lines else ''}".rstrip(": ")


class Peer:
    """FlashInfer in this process (`library`), or why not (`note`); remembers which of its calls failed.

    A call is named by a key naming its module and path ("fa3 paged prefill hd 128"); `build(library)`
    returns (run, out) for it, planned once, exactly as the benchmark builds attnforge's."""

    def __init__(self, library=None, note: str = ""):
        self.library, self.note = library, note
        self.failed: dict[str, str] = {}  # key -> why its call raised

    @classmethod
    def from_args(cls, args) -> "Peer":
        if getattr(args, "no_flashinfer", False):
            return cls(None, NO_FLASHINFER)
        return cls(*flashinfer_or_reason())

    @property
    def present(self) -> bool:
        return self.library is not None

    @property
    def version(self) -> str | None:
        return getattr(self.library, "__version__", "unknown") if self.present else None

    def config(self) -> dict:
        """What a record says about the peer: its version, or the note saying why it did not run."""
        return dict(version=self.version, note=self.note, head_dims=list(HEAD_DIMS),
                    method="same process, same tensors, same plan()/run() arguments and timer as ours")

    def warm(self, calls: dict) -> None:
        """First call of every key -> build, before anything is timed; prints each and its time, as the
        first call JIT-compiles the module (unless FlashInfer's cache holds it already)."""
        if not self.present:
            return
        for key, build in calls.items():
            if key in self.failed:
                continue
            print(f"FlashInfer: first call of {key} (compiles its module unless cached) ...", end=" ",
                  file=sys.stderr, flush=True)
            started = time.perf_counter()
            if self._first_run(key, build) is not None:
                print(f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            else:
                print(f"failed: {self.failed[key]}", file=sys.stderr, flush=True)

    def _first_run(self, key: str, build):
        """(run, out) after one run() and a synchronize, or None with the reason in self.failed."""
        try:
            run, out = build(self.library)
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return run, out
        except Exception as exc:  # the peer refusing is a result, not an error
            self.failed[key] = reason(exc)
            return None

    def timed(self, key: str, build, timer, notes: list, check=None) -> float | None:
        """timer(run) for the peer's call, or None with "FlashInfer KEY n/a: why" in notes. check(out),
        when given, looks at the peer's output after its first run (it appends its own note)."""
        if not self.present:
            return None
        call = None if key in self.failed else self._first_run(key, build)
        try:
            if call is not None:
                if check is not None:
                    check(call[1])
                return timer(call[0])
        except Exception as exc:
            self.failed[key] = reason(exc)
        notes.append(f"FlashInfer {key} n/a: {self.failed[key]}")
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnforge.benchmarks._peers", description=(
        "Build every FlashInfer module the benchmarks time, side by side (FLASHINFER_WORKSPACE_BASE "
        "names its cache)."))
    parser.add_argument("command", choices=["prebuild"])
    parser.parse_args(argv)
    library, note = flashinfer_or_reason()
    if library is None:
        print(note, file=sys.stderr)
        return 1
    from . import fp8

    modules = timed_modules(fp8.DEFAULT_HEAD_DIMS)
    started = time.perf_counter()
    prebuild(modules)
    print(f"FlashInfer: built {len(modules)} modules in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
