"""Batch prefill benchmark: attnforge FA2 and FA3 prefill (paged and ragged) vs FlashInfer's and torch
SDPA, same run; and tensor-core vs CUDA-core decode, ours and FlashInfer's.

    python -m attnforge.benchmarks.prefill [--shapes 16x1024 4x4096 1x16384] [--head-dims 64 128 256]
                                           [--more-head-dims 80 96 ... 512] [--more-shapes 4x4096] [--no-peers] [--no-flashinfer] [--no-decode] [--no-sinks] [--out F.json]

Prefill shape (the acceptance config): bf16, 32 query / 8 kv heads (head dim 256: 16 / 4), head
dim 128 unless --head-dims says otherwise (--more-head-dims: dims timed only at the --more-shapes,
default 4 x 4096), every request L query tokens over the same L kv tokens, causal and non-causal; paged with page size 16 (pages scattered at random) and ragged.
TFLOP/s counts 4 * B * L^2 * Hq * D, halved for causal. Head dim 512 runs on fa2 alone: a backend the
rules refuse at a head dim is n/a in its cells, the rule in the row's notes. Every head dim is checked
against attnforge.reference on a small batch before anything is timed.
Peers: FlashInfer (when importable; --no-flashinfer skips it), its fa2 and fa3 paged and ragged
wrappers driven by the same prefill_call() as ours, so the same tensors, plan() and run() arguments
(TFLOP/s columns flashinfer_*, its output checked against ours of the same call); torch SDPA pinned to
cuDNN and to FLASH_ATTENTION on dense [B, H, L, D] tensors holding the same contents (--no-peers
skips SDPA). Decode: batch 64 x kv 4096, 8 kv heads, hd 128, GQA groups 1, 4, 8, through
BatchDecodeWithPagedKVCacheWrapper on CUDA cores and on tensor cores (fa2, and fa3 on sm90), ours
and FlashInfer's through decode.decode_call(). FlashInfer JIT-compiles a module on first use: every
one the run needs gets its first call (printed, with its time) before anything is timed. A FlashInfer
call that raises is n/a in its cell, the reason in the row's notes; FlashInfer runs at hd 64, 128 and
256 only (its prebuilt dims: elsewhere each first call would JIT-compile for minutes). Sinks (--no-sinks skips them): fa2
and fa3 paged prefill at 4 x 4096, hd 128, causal and not, run() against run(sinks=s) on the same
wrapper; the table's ratio is time without over time with (target >= 0.97: sinks cost at most 3%).

Method: CUDA events around each call, median after warm-up, no L2 flush.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from attnforge.codegen.dtypes import DType
from attnforge.codegen.rules import FA2_WIDE_HEAD_DIMS, HEAD_DIMS, check
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind

from . import _peers, _record, _shapes, decode
from ._timing import SETTLE_SECONDS, copy_bandwidth_gbps, time_cuda_us

NUM_QO_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
# (query, kv) heads per head dim: the acceptance configs (64, 128, 256), and every other head dim the
# rules list for fa2 and fa3 prefill (equal qk/vo), then fa2's wide ones (512; fa3 refuses them, its
# cells n/a with the rule's reason): 32 / 8 heads up to 128, 16 / 4 above, as at 256.
BENCH_HEAD_DIMS = HEAD_DIMS + tuple(sorted(qk for qk, vo in FA2_WIDE_HEAD_DIMS if qk == vo))
HEADS_BY_HEAD_DIM = {dim: (NUM_QO_HEADS, NUM_KV_HEADS) if dim <= HEAD_DIM else (16, 4) for dim in BENCH_HEAD_DIMS}
PAGE_SIZE = 16
DTYPE = torch.bfloat16
WORKSPACE_BYTES = 256 << 20
DECODE_BATCH, DECODE_KV_LEN, DECODE_GROUPS = 64, 4096, (1, 4, 8)
# The sinks table: paged prefill at this shape and HEAD_DIM, timed without and with sinks on one wrapper,
# alternately SINKS_ROUNDS times each (the fastest of each kept: a 3% target is near the clock's drift).
SINKS_BATCH, SINKS_LENGTH, SINKS_ROUNDS = 4, 4096, 3
# Sink logits: large enough to change every row's output (its denominator over 4096 keys is about
# 4096 * e^0.5 ~ e^8.9), so a run that ignored them would show in max_abs_vs_no_sinks; the work a
# kernel does does not depend on their values.
SINK_LOGIT = 8.0
# fa3 runs only on sm90; elsewhere the table shows fa2 alone
BACKENDS = ("fa2", "fa3") if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else ("fa2",)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="attnforge bench prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=_shapes.batch_by_length, default=[(16, 1024), (4, 4096), (1, 16384)],
                   help="BATCHxLEN (default: 16x1024 4x4096 1x16384)")
    p.add_argument("--head-dims", nargs="+", type=int, choices=sorted(HEADS_BY_HEAD_DIM), default=[HEAD_DIM],
                   help="head dims (default 128; any of " + " ".join(map(str, BENCH_HEAD_DIMS)) + "); above 128 "
                        "they run with 16 query / 4 kv heads; a backend the rules refuse at a dim (fa3 at 512) is n/a "
                        "with the rule's reason")
    _shapes.add_more_head_dims(p, sorted(HEADS_BY_HEAD_DIM), (4, 4096))
    p.add_argument("--iters", type=int, default=30, help="timed calls per kernel (median reported)")
    p.add_argument("--warmup", type=int, default=5, help=f"untimed calls first (the warm-up lasts {SETTLE_SECONDS:g} s at least)")
    p.add_argument("--no-peers", action="store_true", help="skip the torch SDPA peers")
    p.add_argument("--no-decode", action="store_true", help="skip the tensor-core vs CUDA-core decode table")
    p.add_argument("--no-sinks", action="store_true",
                   help=f"skip the sinks table (paged prefill at {SINKS_BATCH} x {SINKS_LENGTH} hd {HEAD_DIM} "
                        "without and with attention sinks)")
    _peers.add_option(p)
    _record.add_out_option(p)
    return p.parse_args(argv)


@dataclass(frozen=True)
class Heads:
    qo: int
    kv: int
    dim: int

    @staticmethod
    def for_head_dim(dim: int) -> "Heads":
        return Heads(*HEADS_BY_HEAD_DIM[dim], dim)


ACCEPTANCE = Heads.for_head_dim(HEAD_DIM)


@dataclass
class Problem:
    heads: Heads
    q: torch.Tensor  # [B*L, Hq, D]
    k: torch.Tensor  # [B*L, Hkv, D] ragged
    v: torch.Tensor
    qo_indptr: torch.Tensor  # host int32 [B+1]
    cache: tuple  # paged (k, v) NHD
    page_indptr: torch.Tensor
    page_ids: torch.Tensor  # device int32
    last_page_len: torch.Tensor


def make_problem(batch: int, length: int, h: Heads = ACCEPTANCE, seed: int = 0, device: str = "cuda") -> Problem:
    gen = torch.Generator(device=device).manual_seed(seed)
    total = batch * length
    q, k, v = (torch.randn(total, heads, h.dim, dtype=DTYPE, device=device, generator=gen)
               for heads in (h.qo, h.kv, h.kv))
    indptr = torch.arange(0, total + 1, length, dtype=torch.int32)
    pages_per = -(-length // PAGE_SIZE)
    pool = batch * pages_per
    page_ids = torch.randperm(pool, device=device, generator=gen).to(torch.int32)
    cache = []
    for dense in (k, v):
        padded = torch.zeros(batch, pages_per * PAGE_SIZE, h.kv, h.dim, dtype=DTYPE, device=device)
        padded[:, :length] = dense.view(batch, length, h.kv, h.dim)
        paged = torch.empty(pool, PAGE_SIZE, h.kv, h.dim, dtype=DTYPE, device=device)
        paged.index_copy_(0, page_ids.long(), padded.view(pool, PAGE_SIZE, h.kv, h.dim))
        cache.append(paged)
    last = torch.full((batch,), length - (pages_per - 1) * PAGE_SIZE, dtype=torch.int32)
    return Problem(h, q, k, v, indptr, tuple(cache), torch.arange(0, pool + 1, pages_per, dtype=torch.int32),
                   page_ids, last)


def refusal(backend: str, dim: int, archs: tuple[Arch, ...] = (Arch.SM90A,)) -> str | None:
    """Why the rules refuse `backend`'s bf16 prefill at head dim `dim` (qk = vo) for `archs` (each
    violated rule rendered: "[id] message -> suggestion"), or None. fa3 is checked at sm90a alone, as
    the runtime builds it."""
    archs = (Arch.SM90A,) if backend == "fa3" else archs
    spec = KernelSpec(kind=Kind.PREFILL, backend=Backend(backend), dtype_q=DType.BF16, dtype_kv=DType.BF16,
                      dtype_o=DType.BF16, head_dim_qk=dim, head_dim_vo=dim, archs=archs)
    return "; ".join(rule.render(spec) for rule in check(spec)) or None


def backends_at(dim: int, notes: list | None = None) -> tuple[str, ...]:
    """The BACKENDS the rules accept at head dim `dim`; each refused one "BACKEND n/a: why" in notes."""
    accepted = []
    for backend in BACKENDS:
        why = refusal(backend, dim)
        if why is None:
            accepted.append(backend)
        elif notes is not None:
            notes.append(f"{backend} n/a: {why}")
    return tuple(accepted)


def prefill_call(library, problem: Problem, causal: bool, paged: bool, backend: str, scales: dict | None = None):
    """Plans once through `library`'s prefill wrapper (attnforge or FlashInfer: the same calls) and returns
    (run, out); run(**extra) passes extra keywords to run() (sinks=...) on the same wrapper. The problem's
    dtypes are the plan's, the output is bf16. An fp8 problem runs with
    `scales` (q_scale, k_scale, v_scale): after the cache, positionally, when q is fp8 (FlashInfer's fa3
    fp8 form; its ragged run reads them nowhere else), else as keywords (k_scale, v_scale of an fp8 cache)."""
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=problem.q.device)
    out = torch.empty(problem.q.shape, dtype=DTYPE, device=problem.q.device)
    h = problem.heads
    types = dict(q_data_type=problem.q.dtype, kv_data_type=problem.k.dtype, o_data_type=DTYPE)
    scales = scales or {}
    args = tuple(scales[name] for name in ("q_scale", "k_scale", "v_scale")) if problem.q.element_size() == 1 else ()
    kwargs = {} if args else scales
    if paged:
        wrapper = library.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        wrapper.plan(problem.qo_indptr, problem.page_indptr, problem.page_ids, problem.last_page_len, h.qo, h.kv,
                     h.dim, PAGE_SIZE, causal=causal, **types)
        return (lambda **extra: wrapper.run(problem.q, problem.cache, *args, out=out, **kwargs, **extra)), out
    wrapper = library.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
    wrapper.plan(problem.qo_indptr, problem.qo_indptr, h.qo, h.kv, h.dim, causal=causal, **types)
    return (lambda **extra: wrapper.run(problem.q, problem.k, problem.v, *args, out=out, **kwargs, **extra)), out


def ours(problem: Problem, causal: bool, paged: bool, backend: str, scales: dict | None = None):
    """prefill_call through attnforge."""
    import attnforge

    return prefill_call(attnforge, problem, causal, paged, backend, scales)


def sdpa(problem: Problem, batch: int, causal: bool, backend):
    from torch.nn.attention import sdpa_kernel

    def dense(x):  # [B*L, H, D] -> [B, H, L, D]
        return x.view(batch, -1, x.shape[1], x.shape[2]).transpose(1, 2)

    q, k, v = dense(problem.q), dense(problem.k), dense(problem.v)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return run, run().transpose(1, 2).reshape(problem.q.shape)


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max abs) of out against ref; NaN when either holds a NaN."""
    diff = out.float() - ref.float()
    return (diff.norm() / ref.float().norm().clamp_min(1e-30)).item(), diff.abs().max().item()


# A peer computes from the same bf16 inputs at the same precision: its output must match ours to this
# relative L2 (the observed spread is a few 1e-3), or the row's notes say it does not.
PEER_MAX_REL_L2 = 1e-2


def sdpa_peer_us(problem: Problem, batch: int, causal: bool, name: str, backend, ours_out: torch.Tensor, args,
                 notes: list, errors: dict | None = None) -> float | None:
    """SDPA pinned to one backend: microseconds, or None with the reason in notes (a refusing backend
    is reported, not fatal). errors[name] gets the peer's relative L2 against ours_out."""
    if args.no_peers:
        return None
    with warnings.catch_warnings(record=True) as warned:  # torch warns why a pinned backend refuses
        warnings.simplefilter("always")
        try:
            run, peer_out = sdpa(problem, batch, causal, backend)
            rel_l2, _ = error_stats(peer_out, ours_out)
            if errors is not None:
                errors[name] = rel_l2
            if not rel_l2 <= PEER_MAX_REL_L2:
                notes.append(f"{name} output differs from ours by relative L2 {rel_l2:.3g}")
            return time_cuda_us(run, args.iters, args.warmup)
        except Exception as exc:
            notes.append(sdpa_refusal(name, exc, [str(w.message) for w in warned]))
            return None


TORCH_WHERE = re.compile(r"\s*\(Triggered internally at .*$")
# what torch says of the backends the benchmark itself turned off (not why the pinned one refused)
TORCH_NOISE = ("not used because:", "has been runtime disabled")


def sdpa_refusal(name: str, exc: BaseException, warned: list[str]) -> str:
    """"NAME n/a: why": the exception's first line, then (after " / ") the reasons torch warned of before raising,
    each once without torch's source location, leaving out what it says of the backends turned off for the
    pin ("... not used because:", "... has been runtime disabled"), at most 300 characters."""
    lines = [TORCH_WHERE.sub("", line.strip()) for text in [str(exc)[:120], *warned]
             for line in text.strip().splitlines()[:1]]
    why = " / ".join(dict.fromkeys(line for line in lines if line and not any(n in line for n in TORCH_NOISE)))
    return f"{name} n/a: {why[:300]}"


@dataclass
class Row:
    batch: int
    length: int
    head_dim: int
    causal: bool
    paged_us: float
    ragged_us: float
    paged_tflops: float
    ragged_tflops: float
    fa3_paged_tflops: float | None
    fa3_ragged_tflops: float | None
    cudnn_tflops: float | None
    flash_tflops: float | None
    notes: str = ""
    fa3_paged_us: float | None = None
    fa3_ragged_us: float | None = None
    cudnn_rel_l2_vs_ours: float | None = None  # the peer against our fa2 ragged output, same contents
    flash_rel_l2_vs_ours: float | None = None
    ours_max_abs_spread: float | None = None  # fa2/fa3 paged/ragged outputs against fa2 ragged's
    # FlashInfer's fa2 and fa3 on the same tensors and calls (None: not run, or n/a with the reason in notes)
    flashinfer_paged_tflops: float | None = None
    flashinfer_ragged_tflops: float | None = None
    flashinfer_fa3_paged_tflops: float | None = None
    flashinfer_fa3_ragged_tflops: float | None = None
    flashinfer_rel_l2_vs_ours: float | None = None  # the worst of its outputs against ours of the same call


VERIFY_BATCH, VERIFY_LENGTH = 3, 300


def verify(head_dims=(HEAD_DIM,)) -> list[dict]:
    """Ours vs attnforge.reference on a small ragged batch at each head dim, paged and ragged, causal and
    not, each backend the rules accept there: one {backend, head_dim, paged, causal, max_abs, rel_l2} per
    kernel; AssertionError when one is wrong."""
    from attnforge import reference

    checks = []
    for dim in head_dims:
        problem = make_problem(VERIFY_BATCH, VERIFY_LENGTH, Heads.for_head_dim(dim), seed=1)
        for causal in (False, True):
            o_ref, _ = reference.batch_prefill_ragged(problem.q, problem.k, problem.v, problem.qo_indptr,
                                                      problem.qo_indptr, causal=causal)
            for paged in (False, True):
                for backend in backends_at(dim):
                    run, out = ours(problem, causal, paged, backend)
                    out.fill_(math.nan)
                    run()
                    rel_l2, err = error_stats(out, o_ref)
                    if not math.isfinite(err) or err > 2e-2:
                        raise AssertionError(f"{backend} prefill hd {dim} (causal={causal}, paged={paged}) disagrees "
                                             f"with the reference: max |error| = {err}")
                    checks.append(dict(backend=backend, head_dim=dim, paged=paged, causal=causal, max_abs=err,
                                       rel_l2=rel_l2))
    return checks


def flop_count(batch: int, length: int, h: Heads, causal: bool) -> float:
    """4 * B * L^2 * Hq * D (two matmuls), halved for causal."""
    return 4 * batch * length * length * h.qo * h.dim / (2 if causal else 1)


def call_key(backend: str, paged: bool, problem: Problem) -> str:
    """A prefill call's name in the peer's notes: what picks its module and path."""
    fp8 = " e4m3 q/k/v" if problem.q.element_size() == 1 else " e4m3 KV" if problem.k.element_size() == 1 else ""
    return f"{backend}{fp8} {'paged' if paged else 'ragged'} prefill hd {problem.heads.dim}"


def warm_peer(peer: _peers.Peer, head_dims) -> None:
    """The first call of every peer prefill module the run needs, on a small problem, before timing."""
    for dim in head_dims:
        if _peers.skip_note(dim):
            continue
        paths = [(backend, paged) for backend in backends_at(dim) for paged in (True, False)]
        peer.warm(builds(make_problem(1, 128, Heads.for_head_dim(dim)), True, paths))


def checker(ours_out: torch.Tensor, limit: float, errors: list, notes: list, what: str):
    """check(out) for Peer.timed: the peer's output against ours, its relative L2 into errors, a note
    past `limit` (the same contents and maths: a mismatch means the comparison is not like for like)."""
    def check(out: torch.Tensor) -> None:
        rel_l2, _ = error_stats(out, ours_out)
        errors.append(rel_l2)
        if not rel_l2 <= limit:
            notes.append(f"FlashInfer {what} output differs from ours by relative L2 {rel_l2:.3g}")
    return check


def builds(problem: Problem, causal: bool, paths, scales: dict | None = None) -> dict:
    """{call_key: build(library)} of prefill_call on the problem, for each (backend, paged) of paths."""
    return {call_key(backend, paged, problem): (
        lambda lib, b=backend, p=paged: prefill_call(lib, problem, causal, p, b, scales)) for backend, paged in paths}


def peer_us(peer: _peers.Peer, builds: dict, ours_outs: dict, args, notes: list, limit: float = PEER_MAX_REL_L2):
    """({key: FlashInfer's µs, None when n/a (the reason in notes)}, the worst relative L2 of its outputs
    against ours_outs[key], ours of the same call or of the same contents) for each key -> build."""
    errors = []
    times = {key: peer.timed(key, build, lambda run: time_cuda_us(run, args.iters, args.warmup), notes,
                             checker(ours_outs[key], limit, errors, notes, key)) for key, build in builds.items()}
    return times, max(errors, default=None)


def measure(batch: int, length: int, h: Heads, causal: bool, args, peer: _peers.Peer | None = None) -> Row:
    from torch.nn.attention import SDPBackend

    problem = make_problem(batch, length, h)
    flops = flop_count(batch, length, h, causal)
    tflops = lambda us: flops / (us * 1e6)  # noqa: E731
    times, outs, notes = {}, {}, []
    for backend in backends_at(h.dim, notes):
        for paged in (True, False):
            run, outs[backend, paged] = ours(problem, causal, paged, backend)
            times[backend, paged] = time_cuda_us(run, args.iters, args.warmup)
    reference_out = outs["fa2", False]
    spread = max((o.float() - reference_out.float()).abs().max().item() for o in outs.values())
    if spread > 2e-2:
        notes.append("fa2/fa3 paged/ragged outputs differ")
    peers, errors = {}, {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        us = sdpa_peer_us(problem, batch, causal, name, backend, reference_out, args, notes, errors)
        peers[name] = tflops(us) if us else None
    theirs, peer_err = {}, None
    peer = _peers.timed_peer(peer, h.dim, notes)
    if peer is not None:
        us, peer_err = peer_us(peer, builds(problem, causal, outs),
                               {call_key(*path, problem): out for path, out in outs.items()}, args, notes)
        theirs = {path: tflops(us[call_key(*path, problem)]) if us[call_key(*path, problem)] else None for path in outs}
    del problem
    torch.cuda.empty_cache()
    fa3 = {paged: tflops(times["fa3", paged]) if ("fa3", paged) in times else None for paged in (True, False)}
    return Row(batch, length, h.dim, causal, times["fa2", True], times["fa2", False], tflops(times["fa2", True]),
               tflops(times["fa2", False]), fa3[True], fa3[False], peers["cudnn"], peers["flash"], "; ".join(notes),
               times.get(("fa3", True)), times.get(("fa3", False)), errors.get("cudnn"), errors.get("flash"), spread,
               theirs.get(("fa2", True)), theirs.get(("fa2", False)), theirs.get(("fa3", True)),
               theirs.get(("fa3", False)), peer_err)


def fastest_alternately(runs: dict, timer, rounds: int = SINKS_ROUNDS) -> dict:
    """{name: the least of `rounds` timer(run)} for name -> run, the runs timed in turn round after round
    (so the clock's drift reaches each alike)."""
    best = {}
    for _ in range(rounds):
        for name, run in runs.items():
            us = timer(run)
            best[name] = min(us, best.get(name, us))
    return best


# The sinks table's target: sinks cost at most 3%, so no_sinks_over_sinks >= 0.97.
SINKS_TARGET = 0.97


def sinks_row(backend: str, causal: bool, no_sinks_us: float, sinks_us: float, max_abs: float) -> dict:
    """One row of the sinks table: the times, their ratio (without over with: 1 is free, below SINKS_TARGET
    misses the target), and how far the sinks moved the output (0 or NaN: a note)."""
    note = ("" if max_abs > 0 else "the output with sinks is not finite" if math.isnan(max_abs)
            else "sinks changed no output: not applied?")
    return dict(batch=SINKS_BATCH, length=SINKS_LENGTH, head_dim=HEAD_DIM, backend=backend, paged=True, causal=causal,
                no_sinks_us=no_sinks_us, sinks_us=sinks_us, no_sinks_over_sinks=no_sinks_us / sinks_us,
                max_abs_vs_no_sinks=max_abs, notes=note)


def sinks_rows(args) -> list[dict]:
    """Each backend's paged prefill at SINKS_BATCH x SINKS_LENGTH, hd HEAD_DIM, causal and not: run() and
    run(sinks=s) (fp32 [num_qo_heads]) on the same planned wrapper, timed alternately."""
    problem = make_problem(SINKS_BATCH, SINKS_LENGTH, ACCEPTANCE)
    device = problem.q.device
    gen = torch.Generator(device=device).manual_seed(2)
    sinks = SINK_LOGIT + torch.randn(ACCEPTANCE.qo, dtype=torch.float32, device=device, generator=gen)
    rows = []
    for backend in backends_at(HEAD_DIM):
        for causal in (False, True):
            run, out = ours(problem, causal, True, backend)
            run()
            without = out.clone()
            run(sinks=sinks)
            max_abs = (out.float() - without.float()).abs().max().item()
            best = fastest_alternately({"no_sinks": run, "sinks": lambda: run(sinks=sinks)},
                                       lambda fn: time_cuda_us(fn, args.iters, args.warmup))
            rows.append(sinks_row(backend, causal, best["no_sinks"], best["sinks"], max_abs))
    del problem
    torch.cuda.empty_cache()
    return rows


# (column, use_tensor_cores, backend) of the decode table
DECODE_PATHS = (("cuda_cores", False, "auto"),) + tuple((f"tensor_cores_{b}", True, b) for b in BACKENDS)


def decode_rows(args, copy_gbps: float, peer: _peers.Peer | None = None) -> list[dict]:
    """Tensor-core vs CUDA-core decode at batch 64 x kv 4096 for GQA groups 1, 4, 8; ours, and FlashInfer's
    through the same calls (flashinfer_{path}_us, None with the reason in the row's notes)."""
    import attnforge

    table = decode.make_problem(DECODE_BATCH, DECODE_KV_LEN, "NHD")
    kv_bytes = 2 * table.dense_k.numel() * table.dense_k.element_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for group in DECODE_GROUPS:
        q = torch.randn(DECODE_BATCH, NUM_KV_HEADS * group, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        row, outs, notes = {"group": group}, {}, []

        def build(library, tensor_cores, backend):
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
            return decode.decode_call(library, table, "NHD", workspace, tensor_cores, backend, q)

        for key, tensor_cores, backend in DECODE_PATHS:
            run, outs[key] = build(attnforge, tensor_cores, backend)
            us = row[f"{key}_us"] = time_cuda_us(run, args.iters, args.warmup)
            row[f"{key}_pct_copy_bw"] = 100.0 * kv_bytes / (us * 1e3) / copy_gbps
        for key, tensor_cores, backend in DECODE_PATHS if peer is not None else ():
            row[f"flashinfer_{key}_us"] = peer.timed(
                f"{key.replace('_', ' ')} decode", lambda lib: build(lib, tensor_cores, backend),
                lambda run: time_cuda_us(run, args.iters, args.warmup), notes,
                checker(outs[key], PEER_MAX_REL_L2, [], notes, f"{key.replace('_', ' ')} decode"))
        row["max_abs_diff"] = max((o.float() - outs["cuda_cores"].float()).abs().max().item() for o in outs.values())
        row["notes"] = "; ".join(notes)
        rows.append(row)
    return rows


def warm_decode_peer(peer: _peers.Peer) -> None:
    """The first call of every peer decode path of the decode table, on a small problem."""
    small = decode.make_problem(1, PAGE_SIZE, "NHD")
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    peer.warm({f"{key.replace('_', ' ')} decode": (lambda lib, t=tensor_cores, b=backend:
                                                   decode.decode_call(lib, small, "NHD", workspace, t, b))
               for key, tensor_cores, backend in DECODE_PATHS})


def markdown(rows: list[Row], decode_results: list[dict], copy_gbps: float, sinks: list[dict] = ()) -> str:
    lines = ["| batch x len | head dim (q/kv heads) | causal | fa2 paged (µs) | fa2 ragged (µs) | fa2 paged TFLOP/s | fa2 ragged TFLOP/s | "
             "fa3 paged TFLOP/s | fa3 ragged TFLOP/s | SDPA cuDNN TFLOP/s | SDPA FLASH TFLOP/s | fa2 ragged / FLASH | "
             "fa2 paged / ragged time | FlashInfer fa2 paged / ragged / fa3 paged / ragged TFLOP/s | notes |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    fmt = lambda x: f"{x:.1f}" if x is not None else "n/a"  # noqa: E731
    peer_tflops = lambda r: (r.flashinfer_paged_tflops, r.flashinfer_ragged_tflops, r.flashinfer_fa3_paged_tflops,  # noqa: E731
                             r.flashinfer_fa3_ragged_tflops)
    for r in rows:
        vs_flash = f"{r.ragged_tflops / r.flash_tflops:.2f}" if r.flash_tflops else "n/a"
        h = Heads.for_head_dim(r.head_dim)
        lines.append(f"| {r.batch} x {r.length} | {r.head_dim} ({h.qo}/{h.kv}) | {'yes' if r.causal else 'no'} | {r.paged_us:.1f} | {r.ragged_us:.1f} | "
                     f"{r.paged_tflops:.1f} | {r.ragged_tflops:.1f} | {fmt(r.fa3_paged_tflops)} | "
                     f"{fmt(r.fa3_ragged_tflops)} | {fmt(r.cudnn_tflops)} | {fmt(r.flash_tflops)} | "
                     f"{vs_flash} | {r.paged_us / r.ragged_us:.3f} | {' / '.join(map(fmt, peer_tflops(r)))} | "
                     f"{r.notes} |")
    if decode_results:
        lines += ["", f"Decode, batch {DECODE_BATCH} x kv {DECODE_KV_LEN}, {NUM_KV_HEADS} kv heads (copy bandwidth "
                  f"{copy_gbps:.0f} GB/s):", "",
                  "| group | " + " | ".join(f"{key.replace('_', ' ')} (µs) | % copy BW | FlashInfer (µs)"
                                           for key, _, _ in DECODE_PATHS) + " | max abs diff | notes |",
                  "| ---: | " + " | ".join("---: | ---: | ---:" for _ in DECODE_PATHS) + " | ---: | --- |"]
        for d in decode_results:
            cells = " | ".join(f"{d[f'{key}_us']:.1f} | {d[f'{key}_pct_copy_bw']:.1f} | "
                               f"{fmt(d.get(f'flashinfer_{key}_us'))}" for key, _, _ in DECODE_PATHS)
            lines.append(f"| {d['group']} | {cells} | {d['max_abs_diff']:.2g} | {d.get('notes', '')} |")
    if sinks:
        lines += ["", f"Sinks, paged prefill {SINKS_BATCH} x {SINKS_LENGTH}, hd {HEAD_DIM} (target: without / with "
                  f">= {SINKS_TARGET}):", "",
                  "| backend | causal | without sinks (µs) | with sinks (µs) | without / with | max abs vs no sinks | notes |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {s['backend']} | {'yes' if s['causal'] else 'no'} | {s['no_sinks_us']:.1f} | {s['sinks_us']:.1f} | "
                  f"{s['no_sinks_over_sinks']:.3f} | {s['max_abs_vs_no_sinks']:.2g} | {s['notes']} |" for s in sinks]
    return "\n".join(lines)


def config(args, peer: _peers.Peer | None = None) -> dict:
    """What the JSON record says about the problems and the method."""
    heads = {str(dim): dict(num_qo_heads=qo, num_kv_heads=kv) for dim, (qo, kv) in HEADS_BY_HEAD_DIM.items()}
    return dict(dtype="bf16", heads_by_head_dim=heads, page_size=PAGE_SIZE, backends=list(BACKENDS),
                more_head_dims=args.more_head_dims, more_shapes=[f"{b} x {n}" for b, n in args.more_shapes],
                iters=args.iters, warmup=args.warmup, settle_s=SETTLE_SECONDS, l2_flush=False,
                timer="CUDA events per call, median", flops="4 * B * L^2 * Hq * D, halved for causal",
                peers="torch SDPA cuDNN and FLASH on dense [B, H, L, D] tensors of the same contents",
                check_shape=f"{VERIFY_BATCH} x {VERIFY_LENGTH}", flashinfer=peer.config() if peer else None,
                decode=dict(batch=DECODE_BATCH, kv_len=DECODE_KV_LEN, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                            groups=list(DECODE_GROUPS), paths=[key for key, _, _ in DECODE_PATHS]),
                sinks=None if args.no_sinks else dict(
                    rounds=SINKS_ROUNDS, logits=f"{SINK_LOGIT:g} + N(0, 1) per query head, fp32", target=SINKS_TARGET,
                    method="run() and run(sinks=...) on one planned wrapper, timed in turn, the fastest of the "
                           "rounds of each"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attnforge bench prefill: needs a CUDA device", file=sys.stderr)
        return 2
    from attnforge.dispatch import device_archs

    archs = device_archs(torch.cuda.current_device())
    pairs = _shapes.head_dim_shapes(args.head_dims, args.shapes, args.more_head_dims, args.more_shapes)
    head_dims = list(dict.fromkeys(dim for dim, _ in pairs))
    refused = {dim: why for dim in head_dims if (why := refusal("fa2", dim, archs))}
    if refused:  # fa2 is every row's baseline: a head dim it cannot run here has no row
        print("attnforge bench prefill: fa2 refuses " + "; ".join(f"hd {d}: {why}" for d, why in refused.items()),
              file=sys.stderr)
        return 2
    try:
        checks = verify(head_dims)
    except AssertionError as exc:
        print(f"CORRECTNESS CHECK FAILED, not timing: {exc}", file=sys.stderr)
        return 1
    peer = _peers.Peer.from_args(args)
    warm_peer(peer, head_dims)
    if not args.no_decode:
        warm_decode_peer(peer)
    rows = [measure(b, n, Heads.for_head_dim(dim), causal, args, peer)
            for dim, (b, n) in pairs for causal in (False, True)]
    copy_gbps = copy_bandwidth_gbps()
    decode_results = [] if args.no_decode else decode_rows(args, copy_gbps, peer)
    sinks = [] if args.no_sinks else sinks_rows(args)
    print(markdown(rows, decode_results, copy_gbps, sinks))
    if args.out:
        _record.write(args.out, "prefill", argv, config(args, peer),
                      tables=dict(prefill=[asdict(r) for r in rows], tensor_core_decode=decode_results, check=checks,
                                  sinks=sinks),
                      copy_bandwidth_gbps=copy_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
