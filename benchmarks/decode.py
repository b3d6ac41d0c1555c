"""Batch decode benchmark: attnforge vs the copy bandwidth, FlashInfer and torch SDPA, same run.

    python -m attnforge.benchmarks.decode [--batch 1 16 64 256] [--kv-len 1024 4096 16384]
        [--head-dims 64 128 256] [--more-head-dims 80 96 ... 512] [--more-shapes 64x4096] [--kv-dtype bf16 e4m3 e5m2] [--eager] [--graph-runs 10] [--no-sinks]
        [--no-pdl] [--pdl-runs 32] [--no-flashinfer] [--out F.json]

Shape (the acceptance config): bf16 q, 32 query / 8 kv heads, head_dim 128, page size 16,
every request of the batch kv_len tokens long, pages scattered over the pool at random. The KV
cache is bf16 or, with --kv-dtype, fp8 (e4m3 / e5m2, dequantized in the kernel); several kv dtypes
run in one process and fp8 rows report their speed-up over the bf16 row of the same shape.
--head-dims gives rows for other head dims (any the decode rules accept, 64 to 256 and 512), the
heads fixed, at every shape; --more-head-dims gives rows at the --more-shapes only (default 64 x 4096:
issue 38 asks at least 95% of the copy bandwidth there for each head dim); a shape
whose problem would not fit the free device memory is a row of n/a with a note.

Method: every contender that is a wrapper run() (ours and FlashInfer's, CUDA cores and tensor cores)
is timed as a serving engine runs decode: one CUDA graph of --graph-runs back-to-back run() calls,
replayed; CUDA events around each replay after warm-up, the median replay / --graph-runs. (Eager,
the small batches are bound by the host: batch 1 x 1024 takes ~40 µs per call where the kernel takes
~10.) A contender whose graph capture raises is timed eager instead, the reason in the row's notes.
--eager times every run() with CUDA events around each eager call, the median. torch SDPA is one
kernel call with no host-side plan and is always timed eager, per call. No L2 flush by default (the
K/V read per call is 4 MB to 17 GB against a 50-60 MB L2, so only the smallest cases can hit;
--flush-l2 writes a 512 MB buffer before each timed call or replay, outside the timed region: in a
graph only its first run starts from a flushed L2, so use it with --eager). GB/s counts the bytes a
decode must move once: q + K + V + o, K and V at the cache's element size (1 byte for fp8). The copy
bandwidth is a ~4 GB device-to-device tensor copy in the same process, counting read + write bytes;
each row also times an SM kernel copying its own bytes (half read, half written; an elementwise op, as
a copy_ in a CUDA graph becomes a memcpy node, slower from ~1 GB) as its run() calls are timed:
the bandwidth-bound time at that size, launch and ramp included (a 67 MB read cannot run at a 4 GB
copy's rate), the floor for the small shapes.
The SDPA peers get a dense bf16 [B, Hkv, L, D] cache holding the same contents as the paged one; they
run on the bf16 rows only.
Every row times ours on CUDA cores and on tensor cores (use_tensor_cores=True, the prefill kernel:
issue 40 asks batch 1 x 16384 within 5% of the copy-bandwidth bound there), same problem and timer; a
tensor-core call that raises (an fp8 KV head dim without its prefill kernel) is n/a, why in the notes.
FlashInfer (when importable; --no-flashinfer skips it) runs every row at hd 64, 128 or 256 (its prebuilt
dims: elsewhere each first call would JIT-compile for minutes) on its CUDA cores and its tensor cores, through the same decode_call() as ours: the same paged cache, plan() and run() arguments and
timer, its output checked against ours. It is imported and timed after all of ours (importing it slows
attnforge's host path in the process, see _overhead, which the small batches would show): each row's
problem is made again from the same seed, and every FlashInfer module the rows need gets its first
call (it JIT-compiles on first use; printed, with the time) before the first FlashInfer timing. A
FlashInfer call that raises is n/a in its cell and the reason goes to the row's notes.

Sinks (skipped with --no-sinks): at batch 64 x kv 4096, hd 128, bf16 KV, ours on CUDA cores and on
tensor cores, each timed with run(..., sinks=s) (fp32 [num_qo_heads], random) and without, the same
wrapper and timer (both eager where either's graph capture raises); the ratio without / with (issue
38: sinks may cost at most 3%).

PDL (programmatic dependent launch, skipped with --no-pdl): CUDA graphs of --pdl-runs back-to-back
run() calls with enable_pdl False vs True, µs per run and the speed-up; decode at batch 64 x kv 1024
and 4096 on CUDA cores and tensor cores, prefill 16 x 1024 fa3 (see benchmarks/_pdl.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from attnforge.codegen.rules import DECODE_HEAD_DIMS

from . import _overhead, _pdl, _peers, _record, _shapes
from ._decode_problem import (DTYPE, HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, PAGE_SIZE, PEER_WORKSPACE, Problem,
                              make_problem, page_table, problem_bytes)
from ._timing import SETTLE_SECONDS, copy_bandwidth_gbps, time_cuda_us, time_graph_us

KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
PLAN_BATCHES = (1, 64, 256)
PLAN_KV_LEN = 4096
PLAN_CALLS = 200
OVERHEAD_KV_LEN = 1024
OVERHEAD_WORKSPACE = 128 << 20
# FlashInfer's decode paths beside ours: (column suffix, use_tensor_cores)
PEER_PATHS = (("", False), ("_tc", True))
GRAPH_RUNS = 10  # run() calls per CUDA graph in the graph timing
# Every head dim the CUDA-core decode kernel is instantiated for (qk = vo)
HEAD_DIM_CHOICES = sorted(qk for qk, _ in DECODE_HEAD_DIMS)
SINKS_BATCH, SINKS_KV_LEN = 64, 4096


def parse_args(argv):
    p = argparse.ArgumentParser(prog="attnforge bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256], help="batch sizes (default: 1 16 64 256)")
    p.add_argument("--kv-len", type=int, nargs="+", default=[1024, 4096, 16384], help="kv length of every request")
    p.add_argument("--head-dims", type=int, nargs="+", choices=HEAD_DIM_CHOICES, default=[HEAD_DIM], metavar="D",
                   help=f"head dims, each timed on every shape, 32 q / 8 kv heads (default {HEAD_DIM}; any of "
                        f"{' '.join(map(str, HEAD_DIM_CHOICES))})")
    _shapes.add_more_head_dims(p, HEAD_DIM_CHOICES, (64, 4096))
    p.add_argument("--kv-dtype", nargs="+", choices=sorted(KV_DTYPES), default=["bf16"],
                   help="KV cache dtypes, each timed on every shape (default: bf16)")
    p.add_argument("--layout", choices=["NHD", "HND"], default="NHD", help="paged cache layout (default NHD)")
    p.add_argument("--iters", type=int, default=100,
                   help="timed calls (or graph replays) per kernel, the median reported")
    p.add_argument("--warmup", type=int, default=10, help=f"untimed calls first (the warm-up lasts {SETTLE_SECONDS:g} s at least)")
    p.add_argument("--flush-l2", action="store_true", help="write 512 MB between timed calls (or graph replays)")
    p.add_argument("--eager", action="store_true",
                   help="time every run() eager, CUDA events around each call (default: replays of a CUDA graph)")
    p.add_argument("--graph-runs", type=int, default=GRAPH_RUNS,
                   help=f"back-to-back run() calls per CUDA graph in the graph timing (default {GRAPH_RUNS})")
    p.add_argument("--no-sinks", action="store_true", help="skip the attention-sinks cost case")
    p.add_argument("--no-peers", action="store_true", help="skip the torch SDPA peers")
    p.add_argument("--no-plan", action="store_true", help="skip the plan() host-time measurement")
    p.add_argument("--no-overhead", action="store_true", help="skip the run() host-overhead measurement")
    _peers.add_option(p)
    p.add_argument("--no-pdl", action="store_true", help="skip the PDL (programmatic dependent launch) case")
    p.add_argument("--pdl-runs", type=int, default=_pdl.RUNS,
                   help=f"back-to-back runs per CUDA graph in the PDL case (default {_pdl.RUNS})")
    _record.add_out_option(p)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
def every_head_dim(args) -> list[int]:
    """The head dims of the table: --head-dims, then the --more-head-dims not among them."""
    return list(dict.fromkeys(args.head_dims + args.more_head_dims))


def shapes(args, free_bytes: int) -> tuple[list[tuple[int, int, int]], dict[tuple[int, int, int], str]]:
    """The (head dim, batch, kv len) rows in table order, and why each shape that would not fit
    free_bytes of device memory is skipped."""
    configs = [(b, n) for b in args.batch for n in args.kv_len]
    rows = [(d, b, n) for d, (b, n) in _shapes.head_dim_shapes(args.head_dims, configs, args.more_head_dims,
                                                                args.more_shapes)]
    skipped = {s: f"skipped: needs ~{problem_bytes(*s[1:], s[0]) / 2**30:.0f} GiB of device memory, "
                  f"{free_bytes / 2**30:.0f} GiB free" for s in rows if problem_bytes(*s[1:], s[0]) > free_bytes}
    return rows, skipped


# ---------------------------------------------------------------------------------------
# the contenders


def attnforge_decode(problem: Problem, layout: str, tensor_cores: bool = False):
    """Plans once and returns (run, out): run() is what gets timed."""
    import attnforge

    batch = problem.q.shape[0]
    ws_bytes = (PEER_WORKSPACE if tensor_cores else
                attnforge.decode_workspace_size(batch, NUM_QO_HEADS, NUM_KV_HEADS, problem.q.shape[-1],
                                                device=problem.q.device))
    return decode_call(attnforge, problem, layout, torch.empty(ws_bytes, dtype=torch.uint8, device="cuda"),
                       tensor_cores)


def decode_call(library, problem: Problem, layout: str, workspace: torch.Tensor, tensor_cores: bool = False,
                backend: str = "auto", q: torch.Tensor | None = None, cache: tuple | None = None):
    """(run, out) through `library`'s BatchDecodeWithPagedKVCacheWrapper (attnforge or FlashInfer:
    the same calls), planned once on the problem's page table; q and cache default to the problem's
    (another q gives another GQA group, another cache another kv dtype). The output is bf16. run(**extra)
    passes extra arguments to the same wrapper's run() (sinks=)."""
    q = problem.q if q is None else q
    cache = problem.cache if cache is None else cache
    kv_heads = cache[0].shape[2 if layout == "NHD" else 1]
    wrapper = library.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, use_tensor_cores=tensor_cores,
                                                         backend=backend)
    wrapper.plan(
        problem.indptr, problem.indices, problem.last_page_len, q.shape[1], kv_heads, cache[0].shape[-1],
        PAGE_SIZE, q_data_type=q.dtype, kv_data_type=cache[0].dtype, o_data_type=DTYPE,
    )
    out = torch.empty(q.shape, dtype=DTYPE, device=q.device)
    return (lambda **extra: wrapper.run(q, cache, out=out, **extra)), out


def overhead_rows(layout: str, peer: _peers.Peer) -> tuple[list[dict], str]:
    """run()'s host overhead at batch 1 x OVERHEAD_KV_LEN, ours and FlashInfer's, both decode paths,
    each library in a process of its own (_overhead.in_own_process)."""
    rows = []
    for name in ["attnforge"] + (["flashinfer"] if peer.present else []):
        for found in _overhead.in_own_process(name, layout):
            rows.append(dict(library=name, path="tensor cores" if found["tensor_cores"] else "CUDA cores", batch=1,
                             kv_len=OVERHEAD_KV_LEN, eager_us=found["eager_us"], graph_us=found["graph_us"],
                             overhead_us=found["eager_us"] - found["graph_us"], host_us=found["host_us"]))
    return rows, peer.note


def sdpa_decode(problem: Problem, backend):
    """Returns (run, out) for torch SDPA pinned to backend, or raises with the reason."""
    from torch.nn.attention import sdpa_kernel

    q = problem.q.unsqueeze(2)  # [B, Hq, 1, D]
    k, v, gqa = problem.dense_k, problem.dense_v, True
    with sdpa_kernel(backend):
        try:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        except (RuntimeError, TypeError):
            # backend without GQA support: give it explicitly repeated kv heads, if they fit
            group = NUM_QO_HEADS // NUM_KV_HEADS
            need = 2 * k.numel() * k.element_size() * group
            if need > 0.8 * torch.cuda.mem_get_info()[0]:
                raise RuntimeError(f"no enable_gqa and repeated kv heads need {need / 2**30:.1f} GiB")
            k, v, gqa = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False
            out = F.scaled_dot_product_attention(q, k, v)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    return run, out.squeeze(2)


# ---------------------------------------------------------------------------------------
# one row of the table


@dataclass
class Row:
    kv_dtype: str
    batch: int
    kv_len: int
    us: float | None  # None: the shape was skipped (see notes)
    gbps: float | None
    pct_copy_bw: float | None
    cudnn_us: float | None
    flash_us: float | None
    ratio_vs_cudnn: float | None  # time, ours / cuDNN's
    tc_us: float | None = None  # ours on use_tensor_cores=True (the prefill kernel), same problem and timer
    tc_pct_copy_bw: float | None = None
    speedup_vs_bf16_kv: float | None = None
    notes: str = ""
    cudnn_max_abs_vs_ours: float | None = None  # the peer's output against ours, same contents
    flash_max_abs_vs_ours: float | None = None
    # FlashInfer's CUDA-core and tensor-core decode, same problem and calls (None: not run, or n/a: see notes)
    flashinfer_us: float | None = None
    flashinfer_tc_us: float | None = None
    flashinfer_max_abs_vs_ours: float | None = None  # the worse of its two paths' outputs against ours
    head_dim: int = HEAD_DIM
    # An SM kernel moving the row's bytes (read + write), same timer: the bandwidth-bound time at this
    # size, launch and ramp included, which a small decode cannot beat however fast its loop
    copy_us: float | None = None


def verify(problem: Problem, layout: str) -> dict:
    """Ours vs attnforge.reference on this problem: {max_abs, rel_l2}; raises AssertionError when wrong."""
    from attnforge import reference

    run, out = attnforge_decode(problem, layout)
    out.fill_(math.nan)
    run()
    cache = tuple(c.to(DTYPE) for c in problem.cache)  # exact for fp8; the reference gathers 16-bit pages
    o_ref, _ = reference.batch_decode_paged(
        problem.q, cache, problem.indptr, problem.indices, problem.last_page_len, kv_layout=layout
    )
    diff = out.float() - o_ref.float()
    err = diff.abs().max().item()
    if not math.isfinite(err) or err > 2e-2:
        raise AssertionError(f"attnforge decode disagrees with the reference: max |error| = {err}")
    return dict(max_abs=err, rel_l2=(diff.norm() / o_ref.float().norm().clamp_min(1e-30)).item())


def timed_us(run, args, flush, notes: list, what: str) -> float:
    """µs per run() call: time_graph_us over a CUDA graph of args.graph_runs calls, or time_cuda_us per
    eager call with --eager or where the graph's capture raises ("WHAT timed eager: why" into notes)."""
    if not args.eager:
        stream = torch.cuda.current_stream()
        try:
            return time_graph_us(run, args.graph_runs, args.iters, args.warmup, flush)
        except Exception as exc:  # a run() that cannot be captured is timed as it can be, and said so
            torch.cuda.set_stream(stream)  # a failed capture_end leaves torch.cuda.graph's side stream current
            notes.append(f"{what} timed eager, its CUDA graph capture failed: {_peers.reason(exc)}")
    return time_cuda_us(run, args.iters, args.warmup, flush)


def same_bytes_copy_us(nbytes: int, args, flush) -> float:
    """µs of an SM kernel reading nbytes / 2 bytes and writing as many (an elementwise op on int64
    words), timed as the rows' run() calls are (timed_us). Not copy_: inside a CUDA graph a
    device-to-device copy becomes a memcpy node, which ran 20% under the SMs' copy rate from 1 GB
    (H100; equal up to 256 MB)."""
    src = torch.empty(max(nbytes // 16, 1), dtype=torch.int64, device="cuda").random_()
    dst = torch.empty_like(src)
    return timed_us(lambda: torch.bitwise_not(src, out=dst), args, flush, [], "copy")


def skipped_row(kv_name: str, head_dim: int, batch: int, kv_len: int, why: str) -> Row:
    """A shape that was not run: n/a in every cell, why in the notes."""
    return Row(kv_name, batch, kv_len, None, None, None, None, None, None, notes=why, head_dim=head_dim)


def measure(kv_name: str, head_dim: int, batch: int, kv_len: int, args, copy_gbps: float, flush) -> Row:
    from torch.nn.attention import SDPBackend

    problem = make_problem(batch, kv_len, args.layout, KV_DTYPES[kv_name], head_dim=head_dim)
    nbytes = problem.bytes_moved
    notes = []
    run, out = attnforge_decode(problem, args.layout)
    us = timed_us(run, args, flush, notes, "ours")
    gbps = problem.bytes_moved / (us * 1e3)
    try:
        tc_run, _ = attnforge_decode(problem, args.layout, tensor_cores=True)
        tc_us = timed_us(tc_run, args, flush, notes, "ours tensor cores")
    except Exception as exc:  # the CUDA-core path is the one checked and required; this one is reported
        tc_us = None
        notes.append(f"ours tensor cores n/a: {_peers.reason(exc)}")
    tc_pct = 100.0 * problem.bytes_moved / (tc_us * 1e3) / copy_gbps if tc_us else None
    peers, errors = {}, {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        peers[name] = errors[name] = None
        if args.no_peers or kv_name != "bf16":
            continue
        try:
            peer_run, peer_out = sdpa_decode(problem, backend)
            # same contents, same maths: a mismatch means the comparison is not like for like
            err = errors[name] = (peer_out.float() - out.float()).abs().max().item()
            if err > 5e-2:
                notes.append(f"{name} output differs from ours by {err:.3g}")
            peers[name] = time_cuda_us(peer_run, args.iters, args.warmup, flush)  # one kernel call: eager
        except Exception as exc:  # a refusing backend is reported, not fatal
            notes.append(f"{name} n/a: {str(exc).splitlines()[0][:120]}")
    del problem
    torch.cuda.empty_cache()
    copy_us = same_bytes_copy_us(nbytes, args, flush)  # with the problem freed: the largest rows fit either way
    torch.cuda.empty_cache()
    return Row(
        kv_name, batch, kv_len, us, gbps, 100.0 * gbps / copy_gbps, peers["cudnn"], peers["flash"],
        us / peers["cudnn"] if peers["cudnn"] else None, tc_us, tc_pct,
        notes="; ".join(notes),
        cudnn_max_abs_vs_ours=errors["cudnn"], flash_max_abs_vs_ours=errors["flash"], head_dim=head_dim,
        copy_us=copy_us,
    )


def peer_key(tensor_cores: bool, kv_name: str, head_dim: int = HEAD_DIM) -> str:
    return f"{'tensor' if tensor_cores else 'CUDA'}-core decode, {kv_name} KV, hd {head_dim}"


def warm_peer(peer: _peers.Peer, args) -> None:
    """The first call of each FlashInfer decode module the rows need (path x kv dtype x head dim), before timing."""
    calls = {}
    for kv_name in args.kv_dtype:
        for head_dim in every_head_dim(args):
            if _peers.skip_note(head_dim):
                continue
            small = make_problem(1, PAGE_SIZE, args.layout, KV_DTYPES[kv_name], head_dim=head_dim)
            for _, tensor_cores in PEER_PATHS:
                calls[peer_key(tensor_cores, kv_name, head_dim)] = lambda lib, s=small, t=tensor_cores: decode_call(
                    lib, s, args.layout, torch.empty(PEER_WORKSPACE, dtype=torch.uint8, device="cuda"), t)
    peer.warm(calls)


def add_peer(row: Row, args, flush, peer: _peers.Peer) -> None:
    """FlashInfer's CUDA-core and tensor-core decode into the row: the row's problem made again (the same
    seed, so the same contents), the same decode_call and timer; a refusal is n/a plus a note."""
    problem = make_problem(row.batch, row.kv_len, args.layout, KV_DTYPES[row.kv_dtype], head_dim=row.head_dim)
    run, ours_out = attnforge_decode(problem, args.layout)
    run()
    notes, errors = [row.notes] if row.notes else [], []

    def check(out):
        errors.append((out.float() - ours_out.float()).abs().max().item())
        if not errors[-1] <= 5e-2:
            notes.append(f"FlashInfer output differs from ours by {errors[-1]:.3g}")

    for suffix, tensor_cores in PEER_PATHS:
        key = peer_key(tensor_cores, row.kv_dtype, row.head_dim)
        us = peer.timed(key, lambda lib: decode_call(
            lib, problem, args.layout, torch.empty(PEER_WORKSPACE, dtype=torch.uint8, device="cuda"), tensor_cores),
            lambda call: timed_us(call, args, flush, notes, f"FlashInfer {key}"), notes, check)
        setattr(row, f"flashinfer{suffix}_us", us)
    row.flashinfer_max_abs_vs_ours = max(errors, default=None)
    row.notes = "; ".join(notes)


# ---------------------------------------------------------------------------------------
# sinks: what gpt-oss attention sinks cost the decode kernels


@dataclass
class SinksRow:
    path: str  # CUDA cores or tensor cores
    batch: int
    kv_len: int
    us: float | None  # run() without sinks
    sinks_us: float | None  # run(..., sinks=s), the same wrapper and timer
    ratio: float | None  # us / sinks_us: issue 38 wants at least 0.97 (sinks cost at most 3%)
    notes: str = ""


def sinks_rows(args, flush) -> list[SinksRow]:
    """Ours on CUDA cores and tensor cores at SINKS_BATCH x SINKS_KV_LEN (hd 128, bf16 KV), each wrapper
    timed without sinks and with random fp32 [NUM_QO_HEADS] sinks, by one timer (both eager when either
    cannot be captured); a path that raises is n/a plus a note."""
    problem = make_problem(SINKS_BATCH, SINKS_KV_LEN, args.layout)
    device = problem.q.device
    sinks = torch.randn(NUM_QO_HEADS, dtype=torch.float32, device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    rows = []
    for path, tensor_cores in (("CUDA cores", False), ("tensor cores", True)):
        notes, us, sinks_us = [], None, None
        try:
            run, _ = attnforge_decode(problem, args.layout, tensor_cores)
            pair = (run, lambda run=run: run(sinks=sinks))
            us, sinks_us = (timed_us(call, args, flush, notes, f"{what} sinks")
                            for call, what in zip(pair, ("without", "with")))
            if notes and not args.eager:  # one was timed eager: both are, so that they share a timer
                eager = argparse.Namespace(**{**vars(args), "eager": True})
                us, sinks_us = (timed_us(call, eager, flush, notes, "") for call in pair)
        except Exception as exc:  # reported in the table, not fatal: the decode rows are measured already
            notes.append(f"n/a: {_peers.reason(exc)}")
        ratio = us / sinks_us if us and sinks_us else None
        rows.append(SinksRow(path, SINKS_BATCH, SINKS_KV_LEN, us, sinks_us, ratio, "; ".join(notes)))
    del problem
    torch.cuda.empty_cache()
    return rows


def add_speedups(rows: list[Row]) -> None:
    """Each fp8 row's speed-up over the bf16 row of its head dim and shape (when both were run)."""
    bf16_us = {(r.head_dim, r.batch, r.kv_len): r.us for r in rows if r.kv_dtype == "bf16" and r.us}
    for r in rows:
        key = (r.head_dim, r.batch, r.kv_len)
        if r.kv_dtype != "bf16" and r.us and key in bf16_us:
            r.speedup_vs_bf16_kv = bf16_us[key] / r.us


def plan_host_us(batch: int, layout: str, calls: int = PLAN_CALLS) -> float:
    """Median host time of one plan() call at kv_len 4096 (after warm-up)."""
    import attnforge

    indptr, indices, last = page_table(batch, PLAN_KV_LEN, batch * PLAN_KV_LEN // PAGE_SIZE, torch.Generator())
    ws_bytes = attnforge.decode_workspace_size(batch, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, device=indices.device)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout=layout)

    def once():
        wrapper.plan(indptr, indices, last, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE,
                     q_data_type=DTYPE, kv_data_type=DTYPE)

    for _ in range(20):
        once()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        once()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(samples)


# ---------------------------------------------------------------------------------------
# report


def _fmt(x, spec=".1f"):
    return "n/a" if x is None else format(x, spec)


def overhead_markdown(rows: list[dict], note: str) -> list[str]:
    lines = ["", f"run() host overhead, batch 1 x kv {OVERHEAD_KV_LEN} (µs per call; eager minus graph replay)"
             + (f"; {note}" if note else ""), "",
             "| library | path | eager | graph replay | overhead | host clock |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['library']} | {r['path']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} | {r['overhead_us']:.1f} | "
              f"{r['host_us']:.1f} |" for r in rows]
    return lines


def markdown(rows: list[Row], copy_gbps: float, plans: dict, first_call_s: float, args) -> str:
    lines = [
        f"copy bandwidth (D2D, read+write): {copy_gbps:.0f} GB/s; first plan+run (includes the module "
        f"build when not cached): {first_call_s:.1f} s; timing: {timer(args)}",
        "",
        "| kv dtype | head dim | batch | kv len | time (µs) | GB/s | % of copy BW | tensor cores (µs) "
        "| TC % of copy BW | SDPA cuDNN (µs) | SDPA FLASH (µs) | ours / cuDNN | speed-up vs bf16 KV "
        "| FlashInfer CUDA cores (µs) | FlashInfer tensor cores (µs) | copy of the same bytes (µs) | notes |",
        "| --- |" + " ---: |" * 15 + " --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.kv_dtype} | {r.head_dim} | {r.batch} | {r.kv_len} | {_fmt(r.us)} | {_fmt(r.gbps, '.0f')} | "
            f"{_fmt(r.pct_copy_bw)} | {_fmt(r.tc_us)} | {_fmt(r.tc_pct_copy_bw)} | "
            f"{_fmt(r.cudnn_us)} | {_fmt(r.flash_us)} | {_fmt(r.ratio_vs_cudnn, '.3f')} | "
            f"{_fmt(r.speedup_vs_bf16_kv, '.2f')} | {_fmt(r.flashinfer_us)} | {_fmt(r.flashinfer_tc_us)} | "
            f"{_fmt(r.copy_us)} | {r.notes} |"
        )
    if plans:
        lines += ["", f"| batch | plan() host time (µs, median, kv len {PLAN_KV_LEN}) |", "| ---: | ---: |"]
        lines += [f"| {b} | {us:.1f} |" for b, us in plans.items()]
    return "\n".join(lines)


def sinks_markdown(rows: list[SinksRow]) -> list[str]:
    lines = ["", f"Attention sinks, batch {SINKS_BATCH} x kv {SINKS_KV_LEN}, hd {HEAD_DIM}, bf16 KV "
             "(µs per call; ratio = without / with)", "",
             "| path | without sinks | with sinks | ratio | notes |", "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {r.path} | {_fmt(r.us)} | {_fmt(r.sinks_us)} | {_fmt(r.ratio, '.3f')} | {r.notes} |" for r in rows]
    return lines


def timer(args) -> str:
    """How the run() contenders (and SDPA) are timed, in one clause for the record and the report."""
    if args.eager:
        return "CUDA events around each eager call, the median (--eager), ours, FlashInfer and SDPA alike"
    return (f"ours and FlashInfer (CUDA and tensor cores): one CUDA graph of {args.graph_runs} back-to-back run() "
            f"calls, CUDA events around each replay, the median replay / {args.graph_runs} (as a serving engine runs "
            "decode); a capture that raised is timed eager per call (said in the row's notes); SDPA (one kernel "
            "call): CUDA events around each eager call, the median")


def config(args, peer: _peers.Peer | None = None) -> dict:
    """What the JSON record says about the problem and the method. head_dim is that of the plan, PDL,
    overhead and sinks cases; head_dims those of the decode table."""
    return dict(dtype="bf16", kv_dtypes=args.kv_dtype, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM, head_dims=args.head_dims, more_head_dims=args.more_head_dims,
                more_shapes=[f"{b} x {n}" for b, n in args.more_shapes], page_size=PAGE_SIZE, layout=args.layout,
                iters=args.iters, warmup=args.warmup, settle_s=SETTLE_SECONDS, l2_flush=args.flush_l2,
                graph_runs=None if args.eager else args.graph_runs, timer=timer(args),
                bytes="q + K + V + o", copy="4 GiB D2D copy, read + write",
                same_bytes_copy="an elementwise SM kernel reading and writing half the row's bytes each, timed as the row",
                peers="torch SDPA cuDNN and FLASH on a dense bf16 cache", plan_kv_len=PLAN_KV_LEN,
                sinks=None if args.no_sinks else dict(batch=SINKS_BATCH, kv_len=SINKS_KV_LEN, head_dim=HEAD_DIM,
                                                      kv_dtype="bf16", sinks="fp32 [num_qo_heads], random"),
                pdl=None if args.no_pdl else _pdl.config(args), flashinfer=peer.config() if peer else None)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.pdl_runs < 1 or args.graph_runs < 1:
        print("attnforge bench decode: --pdl-runs and --graph-runs must be at least 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("attnforge bench decode: needs a CUDA device", file=sys.stderr)
        return 2
    configs = [(b, n) for b in args.batch for n in args.kv_len]

    # correctness first, on the smallest config of each kv dtype and head dim; the wall time also shows the cold builds
    t0 = time.perf_counter()
    smallest = min(configs, key=lambda c: c[0] * c[1])
    checks = []
    try:
        for kv_name in args.kv_dtype:
            for head_dim in every_head_dim(args):
                problem = make_problem(*smallest, args.layout, KV_DTYPES[kv_name], head_dim=head_dim)
                errors = verify(problem, args.layout)
                checks.append(dict(kv_dtype=kv_name, batch=smallest[0], kv_len=smallest[1], head_dim=head_dim,
                                   **errors))
    except AssertionError as exc:
        print(f"CORRECTNESS CHECK FAILED ({kv_name} KV, hd {head_dim}), not timing: {exc}", file=sys.stderr)
        return 1
    first_call_s = time.perf_counter() - t0
    torch.cuda.empty_cache()

    copy_gbps = copy_bandwidth_gbps()
    flush_buf = torch.empty(512 << 20, dtype=torch.uint8, device="cuda") if args.flush_l2 else None
    flush = flush_buf.zero_ if flush_buf is not None else None
    torch.cuda.empty_cache()
    ordered, skipped = shapes(args, torch.cuda.mem_get_info()[0])
    rows = [skipped_row(kv, *s, skipped[s]) if s in skipped else measure(kv, *s, args, copy_gbps, flush)
            for kv in args.kv_dtype for s in ordered]
    add_speedups(rows)
    sinks = [] if args.no_sinks else sinks_rows(args, flush)
    plans = {} if args.no_plan else {b: plan_host_us(b, args.layout) for b in PLAN_BATCHES}
    pdl = [] if args.no_pdl else _pdl.decode_rows(args) + _pdl.prefill_rows(args)

    # FlashInfer after every measurement of ours: importing it slows attnforge's host path in this process
    # (see _overhead), which would show in ours at the host-bound small batches
    peer = _peers.Peer.from_args(args)
    warm_peer(peer, args)
    for r in rows if peer.present else ():
        if r.us is None:  # skipped: it would not fit
            continue
        if skipped := _peers.skip_note(r.head_dim):
            r.notes = "; ".join(filter(None, [r.notes, skipped]))
            continue
        add_peer(r, args, flush, peer)
        torch.cuda.empty_cache()

    overhead, overhead_note = ([], "") if args.no_overhead else overhead_rows(args.layout, peer)

    print(markdown(rows, copy_gbps, plans, first_call_s, args))
    if sinks:
        print("\n".join(sinks_markdown(sinks)))
    if overhead:
        print("\n".join(overhead_markdown(overhead, overhead_note)))
    if pdl:
        print("\nPDL: " + _pdl.config(args)["method"] + "\n\n" + _pdl.markdown(pdl))
    if args.out:
        _record.write(args.out, "decode", argv, config(args, peer), tables=dict(
            decode=[asdict(r) for r in rows],
            plan=[dict(batch=b, kv_len=PLAN_KV_LEN, calls=PLAN_CALLS, us=us) for b, us in plans.items()],
            check=checks, overhead=overhead, sinks=[asdict(r) for r in sinks],
            pdl=[asdict(r) for r in pdl],
        ), copy_bandwidth_gbps=copy_gbps, first_plan_run_s=first_call_s, overhead_note=overhead_note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
