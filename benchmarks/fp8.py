"""FP8 benchmark: attnforge FA3 e4m3 prefill vs our FA3 bf16 and torch SDPA cuDNN bf16, FA2 prefill of a
bf16 query over an e4m3 KV cache vs a bf16 one, and fp8-KV vs bf16-KV decode on the FA2 (CUDA-core
and tensor-core) and FA3 (tensor-core) paths, same run.

    python -m attnforge.benchmarks.fp8 [--shapes 4x4096] [--head-dims 128 256] [--no-decode] [--no-flashinfer]
                                       [--out F.json]

Prefill shape (the acceptance config): 32 query / 8 kv heads (head dim 256: 16 / 4), every request L
query tokens over the same L kv tokens, causal and non-causal. fp8: e4m3 q, k, v, each randn divided
by its scale (SCALES) and rounded, bf16 output; paged (page size 16, pages scattered) and ragged.
bf16 and cuDNN get the same contents: the fp8 values times their scale, exact in bf16. TFLOP/s counts
4 * B * L^2 * Hq * D, halved for causal, for every dtype. FA2 fp8-KV prefill: the same shapes, the
bf16 q with the e4m3 k, v (k_scale, v_scale) against the bf16 q, k, v of the same values. Decode:
batch 64 x kv 4096, 8 kv heads, hd 128, page 16, GQA groups 1, 4, 8; bf16 KV vs e4m3 KV (the same
values) on fa2's CUDA cores and tensor cores, and on sm90 the fa3 tensor-core path with bf16 q/KV vs
e4m3 q/KV (the fp8 wgmma takes both operands fp8).

FlashInfer (when importable; --no-flashinfer skips it) runs beside ours on the same tensors through
the same prefill.prefill_call() / decode.decode_call(): fa3 e4m3 prefill (the scales passed after the
kv tensors, positionally: FlashInfer 0.7.4's fp8 form, the only one its ragged run reads), fa2 prefill
over the e4m3 cache (k_scale, v_scale as keywords), and each decode path with bf16 and fp8 KV. Its
outputs are checked against our bf16 output as ours are (a mismatch is a note, not a stop); a call it
refuses is n/a, the reason in the row's notes. Every FlashInfer module the run needs gets its first
call (a JIT compile on first use; printed, with its time) before anything is timed.

Method: CUDA events around each call, median after warm-up, no L2 flush. Before timing, every fp8
output is poisoned with NaN, computed once and compared with the bf16 output of the same contents;
a NaN or a relative L2 error above 5e-2 stops the run (exit 1) instead of timing a wrong kernel.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, replace

import torch

from attnforge.codegen.rules import FA3_FP8_PREFILL_HEAD_DIMS

from . import _peers, _record, _shapes, decode, prefill
from ._timing import SETTLE_SECONDS, copy_bandwidth_gbps, time_cuda_us
from .decode import _fmt

E4M3 = torch.float8_e4m3fn
DTYPE = prefill.DTYPE
# head dims with both an fa3 fp8 kernel and acceptance heads; the acceptance config runs 128 and 256
HEAD_DIMS = sorted(qk for qk, vo in FA3_FP8_PREFILL_HEAD_DIMS if qk == vo and qk in prefill.HEADS_BY_HEAD_DIM)
DEFAULT_HEAD_DIMS = [128, 256]
# The dims FlashInfer's fp8 modules are timed at: those `_peers prebuild` builds (timed_modules). At
# another its first call would JIT-compile two modules (~100 s each), so those cells are n/a.
PEER_HEAD_DIMS = tuple(DEFAULT_HEAD_DIMS)
# fp8 output vs the bf16 output of the same contents: e4m3 P keeps 3 mantissa bits, so a few percent
MAX_REL_L2 = 5e-2


@dataclass(frozen=True)
class Scales:
    """Per-tensor dequantization scales: the fp8 tensor stands for its value times the scale."""

    q: float
    k: float
    v: float

    @property
    def kwargs(self) -> dict:
        return dict(q_scale=self.q, k_scale=self.k, v_scale=self.v)


# q and k fold into the softmax scale for free (their product is not 1, so a dropped scale fails the
# check); v is 1 because any other v_scale costs a separate out *= v_scale pass over o in the runtime,
# which is not the kernel under test.
SCALES = Scales(q=0.5, k=0.75, v=1.0)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="attnforge bench fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=_shapes.batch_by_length, default=[(4, 4096)],
                   help="BATCHxLEN (default: 4x4096)")
    p.add_argument("--head-dims", nargs="+", type=int, choices=HEAD_DIMS, default=DEFAULT_HEAD_DIMS,
                   help="head dims (default: 128 256; any of " + " ".join(map(str, HEAD_DIMS))
                        + "); above 128 they run with 16 query / 4 kv heads")
    p.add_argument("--iters", type=int, default=20, help="timed calls per kernel (median reported)")
    p.add_argument("--warmup", type=int, default=5, help=f"untimed calls first (the warm-up lasts {SETTLE_SECONDS:g} s at least)")
    p.add_argument("--no-peers", action="store_true", help="skip the torch SDPA cuDNN peer")
    p.add_argument("--no-decode", action="store_true", help="skip the fp8-KV vs bf16-KV decode table")
    _peers.add_option(p)
    _record.add_out_option(p)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# fp8 contents and the bf16 tensors that hold the same values


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).to(E4M3)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact: an e4m3 value (4 significant bits) times a scale of at most 2 significant bits fits bf16."""
    return (x.float() * scale).to(DTYPE)


def converted(problem: prefill.Problem, fn, scales: Scales = SCALES) -> prefill.Problem:
    """fn(tensor, scale) on q, k, v and the paged cache; elementwise, so the pages still hold k and v."""
    k_cache, v_cache = problem.cache
    return replace(problem, q=fn(problem.q, scales.q), k=fn(problem.k, scales.k), v=fn(problem.v, scales.v),
                   cache=(fn(k_cache, scales.k), fn(v_cache, scales.v)))


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> tuple[float, float]:
    """error_stats of an fp8 output vs the bf16 one; AssertionError when it is not fit to be timed."""
    rel_l2, max_abs = prefill.error_stats(out, ref)
    if not rel_l2 <= MAX_REL_L2:  # also catches NaN
        raise AssertionError(f"{what}: fp8 output vs bf16 relative L2 {rel_l2:.3g} (limit {MAX_REL_L2:g}), "
                             f"max abs {max_abs:.3g}")
    return rel_l2, max_abs


def checked_once(runs: dict, ref_key: str, what: str) -> tuple[float, float]:
    """Poisons every output, runs each call once, checks every other output against runs[ref_key]'s;
    returns the worst (relative L2, max abs)."""
    for _, out in runs.values():
        out.fill_(math.nan)
    for run, _ in runs.values():
        run()
    ref = runs[ref_key][1]
    stats = [check(out, ref, f"{what}, {key}") for key, (_, out) in runs.items() if key != ref_key]
    return max(s[0] for s in stats), max(s[1] for s in stats)


# ---------------------------------------------------------------------------------------
# prefill


@dataclass
class PrefillRow:
    batch: int
    length: int
    head_dim: int
    causal: bool
    fp8_paged_tflops: float
    fp8_ragged_tflops: float
    bf16_ragged_tflops: float
    cudnn_tflops: float | None
    rel_l2: float  # fp8 vs bf16 output, the worse of paged and ragged
    max_abs: float
    notes: str = ""
    cudnn_rel_l2_vs_bf16: float | None = None  # the peer against our bf16 output, same contents
    # FlashInfer's fa3 e4m3 prefill on the same tensors and calls (None: not run, or n/a: see notes)
    flashinfer_fp8_paged_tflops: float | None = None
    flashinfer_fp8_ragged_tflops: float | None = None
    flashinfer_rel_l2_vs_bf16: float | None = None  # its fp8 outputs against our bf16 one, the worse

    @property
    def fp8_vs_bf16(self) -> float:
        return self.fp8_ragged_tflops / self.bf16_ragged_tflops

    @property
    def fp8_vs_cudnn(self) -> float | None:
        return self.fp8_ragged_tflops / self.cudnn_tflops if self.cudnn_tflops else None


def peer_tflops(peer, problem: prefill.Problem, causal: bool, backend: str, scales: dict, ref: torch.Tensor,
                flops: float, args, notes: list) -> tuple[dict, float | None]:
    """({paged: FlashInfer's TFLOP/s or None}, the worst relative L2 of its outputs against ref) of the
    peer's paged and ragged prefill_call on the fp8 problem; none when the peer is not given."""
    if peer is None:
        return {}, None
    builds = prefill.builds(problem, causal, [(backend, True), (backend, False)], scales)
    us, err = prefill.peer_us(peer, builds, dict.fromkeys(builds, ref), args, notes, MAX_REL_L2)
    times = {paged: us[prefill.call_key(backend, paged, problem)] for paged in (True, False)}
    return {paged: flops / (t * 1e6) if t else None for paged, t in times.items()}, err


def measure_prefill(batch: int, length: int, h: prefill.Heads, causal: bool, args, peer=None) -> PrefillRow:
    from torch.nn.attention import SDPBackend

    fp8 = converted(prefill.make_problem(batch, length, h), quantize)
    bf16 = converted(fp8, dequantize)
    runs = {
        "fp8 paged": prefill.ours(fp8, causal, True, "fa3", SCALES.kwargs),
        "fp8 ragged": prefill.ours(fp8, causal, False, "fa3", SCALES.kwargs),
        "bf16 ragged": prefill.ours(bf16, causal, False, "fa3"),
    }
    rel_l2, max_abs = checked_once(runs, "bf16 ragged", f"fa3 prefill {batch}x{length} hd {h.dim} causal={causal}")
    flops = prefill.flop_count(batch, length, h, causal)
    tflops = {key: flops / (time_cuda_us(run, args.iters, args.warmup) * 1e6) for key, (run, _) in runs.items()}
    notes, errors = [], {}
    cudnn_us = prefill.sdpa_peer_us(bf16, batch, causal, "cudnn", SDPBackend.CUDNN_ATTENTION, runs["bf16 ragged"][1],
                                    args, notes, errors)
    peer = _peers.timed_peer(peer, h.dim, notes, PEER_HEAD_DIMS)
    theirs, peer_err = peer_tflops(peer, fp8, causal, "fa3", SCALES.kwargs, runs["bf16 ragged"][1], flops, args, notes)
    del fp8, bf16, runs
    torch.cuda.empty_cache()
    return PrefillRow(batch, length, h.dim, causal, tflops["fp8 paged"], tflops["fp8 ragged"], tflops["bf16 ragged"],
                      flops / (cudnn_us * 1e6) if cudnn_us else None, rel_l2, max_abs, "; ".join(notes),
                      errors.get("cudnn"), theirs.get(True), theirs.get(False), peer_err)


def prefill_rows(args, peer=None) -> list[PrefillRow]:
    """Every head dim x shape, non-causal then causal; none off sm90, where fa3 does not run."""
    if "fa3" not in prefill.BACKENDS:
        print("attnforge bench fp8: fa3 fp8 prefill needs sm90; skipping the prefill table", file=sys.stderr)
        return []
    return [measure_prefill(b, n, prefill.Heads.for_head_dim(dim), causal, args, peer)
            for dim in args.head_dims for b, n in args.shapes for causal in (False, True)]


@dataclass
class Fp8KvPrefillRow:
    """fa2 prefill of a bf16 query over an e4m3 KV cache (widened in the kernel) vs the bf16 cache."""

    batch: int
    length: int
    head_dim: int
    causal: bool
    fp8_kv_paged_tflops: float
    fp8_kv_ragged_tflops: float
    bf16_ragged_tflops: float
    rel_l2: float  # fp8-KV vs bf16 output, the worse of paged and ragged
    max_abs: float
    notes: str = ""
    # FlashInfer's fa2 over the e4m3 cache, same tensors and calls (None: not run, or n/a: see notes)
    flashinfer_fp8_kv_paged_tflops: float | None = None
    flashinfer_fp8_kv_ragged_tflops: float | None = None
    flashinfer_rel_l2_vs_bf16: float | None = None

    @property
    def fp8_kv_vs_bf16(self) -> float:
        return self.fp8_kv_ragged_tflops / self.bf16_ragged_tflops


def fp8_kv_problem(problem: prefill.Problem) -> tuple[prefill.Problem, prefill.Problem]:
    """(bf16 q over the e4m3 k/v and cache, the bf16 problem of the same values) from a bf16 problem."""
    fp8 = converted(problem, quantize)
    bf16 = converted(fp8, dequantize)
    return replace(fp8, q=bf16.q), bf16


KV_SCALES = dict(k_scale=SCALES.k, v_scale=SCALES.v)


def measure_fp8_kv_prefill(batch: int, length: int, h: prefill.Heads, causal: bool, args,
                           peer=None) -> Fp8KvPrefillRow:
    fp8_kv, bf16 = fp8_kv_problem(prefill.make_problem(batch, length, h))
    runs = {
        "fp8-KV paged": prefill.ours(fp8_kv, causal, True, "fa2", KV_SCALES),
        "fp8-KV ragged": prefill.ours(fp8_kv, causal, False, "fa2", KV_SCALES),
        "bf16 ragged": prefill.ours(bf16, causal, False, "fa2"),
    }
    rel_l2, max_abs = checked_once(runs, "bf16 ragged", f"fa2 prefill {batch}x{length} hd {h.dim} causal={causal}")
    flops = prefill.flop_count(batch, length, h, causal)
    tflops = {key: flops / (time_cuda_us(run, args.iters, args.warmup) * 1e6) for key, (run, _) in runs.items()}
    notes = []
    peer = _peers.timed_peer(peer, h.dim, notes, PEER_HEAD_DIMS)
    theirs, peer_err = peer_tflops(peer, fp8_kv, causal, "fa2", KV_SCALES, runs["bf16 ragged"][1], flops, args, notes)
    del bf16, fp8_kv, runs
    torch.cuda.empty_cache()
    return Fp8KvPrefillRow(batch, length, h.dim, causal, tflops["fp8-KV paged"], tflops["fp8-KV ragged"],
                           tflops["bf16 ragged"], rel_l2, max_abs, "; ".join(notes), theirs.get(True),
                           theirs.get(False), peer_err)


def fp8_kv_prefill_rows(args, peer=None) -> list[Fp8KvPrefillRow]:
    return [measure_fp8_kv_prefill(b, n, prefill.Heads.for_head_dim(dim), causal, args, peer)
            for dim in args.head_dims for b, n in args.shapes for causal in (False, True)]


# ---------------------------------------------------------------------------------------
# decode


@dataclass(frozen=True)
class DecodePath:
    name: str
    tensor_cores: bool
    backend: str
    fp8_q: bool  # the fp8 variant quantizes q too


DECODE_PATHS = (DecodePath("CUDA cores (fa2)", False, "auto", fp8_q=False),
                DecodePath("tensor cores (fa2)", True, "fa2", fp8_q=False)) + (
    (DecodePath("tensor cores (fa3), e4m3 q", True, "fa3", fp8_q=True),) if "fa3" in prefill.BACKENDS else ())


@dataclass
class DecodeRow:
    path: str
    group: int
    bf16_us: float
    fp8_us: float
    bf16_pct_copy_bw: float
    fp8_pct_copy_bw: float
    rel_l2: float  # fp8 vs bf16 output
    max_abs: float
    notes: str = ""
    # FlashInfer's decode on the same path, inputs and calls (None: not run, or n/a: see notes)
    flashinfer_bf16_us: float | None = None
    flashinfer_fp8_us: float | None = None

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.fp8_us


def decode_call(library, path: DecodePath, table: decode.Problem, q: torch.Tensor, cache: tuple):
    """Plans once through `library` (attnforge or FlashInfer: decode.decode_call) and returns (run, out)."""
    workspace = torch.empty(prefill.WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    return decode.decode_call(library, table, "NHD", workspace, path.tensor_cores, path.backend, q, cache)


def decode_key(path: DecodePath, kv: str) -> str:
    return f"{path.name} decode, {kv} KV"


def decode_builds(path: DecodePath, table: decode.Problem, variants: dict) -> dict:
    """{decode_key: build(library)} of decode_call for each variant ("bf16"/"fp8" -> (q, cache))."""
    return {decode_key(path, key): (lambda lib, q=q, cache=cache: decode_call(lib, path, table, q, cache))
            for key, (q, cache) in variants.items()}


def decode_variants(path: DecodePath, table: decode.Problem, cache16: tuple, group: int) -> dict:
    """{"bf16": (q, bf16 cache), "fp8": (q, e4m3 cache)}: one q of the same values, e4m3 in the fp8 variant
    of a path that quantizes q too."""
    kv_heads, head_dim = cache16[0].shape[2:]
    gen = torch.Generator(device="cuda").manual_seed(group)
    q8 = torch.randn(table.q.shape[0], kv_heads * group, head_dim, device="cuda", generator=gen).to(E4M3)
    q16 = q8.to(DTYPE)  # the same values for both variants
    return {"bf16": (q16, cache16), "fp8": (q8 if path.fp8_q else q16, table.cache)}


def bytes_moved(table: decode.Problem, q: torch.Tensor, cache: tuple) -> int:
    """What a decode must move once: q + K + V + o (bf16), K and V at the cache's element size."""
    return q.nbytes + q.numel() * DTYPE.itemsize + 2 * table.dense_k.numel() * cache[0].element_size()


def measure_decode(path: DecodePath, table: decode.Problem, cache16: tuple, group: int, args,
                   copy_gbps: float, peer=None) -> DecodeRow:
    variants = decode_variants(path, table, cache16, group)
    import attnforge

    runs = {key: decode_call(attnforge, path, table, q, cache) for key, (q, cache) in variants.items()}
    rel_l2, max_abs = checked_once(runs, "bf16", f"{path.name} decode, group {group}")
    us = {key: time_cuda_us(run, args.iters, args.warmup) for key, (run, _) in runs.items()}
    pct = {key: 100.0 * bytes_moved(table, *variants[key]) / (us[key] * 1e3) / copy_gbps for key in runs}
    notes, theirs = [], {}
    if peer is not None:  # each checked against our bf16 output, as ours are
        builds = decode_builds(path, table, variants)
        theirs, _ = prefill.peer_us(peer, builds, dict.fromkeys(builds, runs["bf16"][1]), args, notes, MAX_REL_L2)
    return DecodeRow(path.name, group, us["bf16"], us["fp8"], pct["bf16"], pct["fp8"], rel_l2, max_abs,
                     "; ".join(notes), theirs.get(decode_key(path, "bf16")), theirs.get(decode_key(path, "fp8")))


def warm_peer(peer, args) -> None:
    """The first call of every FlashInfer module the run needs, on small problems, before timing."""
    for dim in (d for d in args.head_dims if not _peers.skip_note(d, PEER_HEAD_DIMS)):
        small = prefill.make_problem(1, 128, prefill.Heads.for_head_dim(dim))
        if "fa3" in prefill.BACKENDS:
            peer.warm(prefill.builds(converted(small, quantize), True, [("fa3", True), ("fa3", False)], SCALES.kwargs))
        peer.warm(prefill.builds(fp8_kv_problem(small)[0], True, [("fa2", True), ("fa2", False)], KV_SCALES))
    if not args.no_decode:
        table = decode.make_problem(1, decode.PAGE_SIZE, "NHD", E4M3)
        cache16 = tuple(c.to(DTYPE) for c in table.cache)
        for path in DECODE_PATHS:
            peer.warm(decode_builds(path, table, decode_variants(path, table, cache16, prefill.DECODE_GROUPS[0])))


def decode_rows(args, copy_gbps: float, peer=None) -> list[DecodeRow]:
    """fp8-KV vs bf16-KV decode at batch 64 x kv 4096 for GQA groups 1, 4, 8, on every path."""
    # e4m3 pages (and dense bf16 copies of the same values, counted for the bytes moved)
    table = decode.make_problem(prefill.DECODE_BATCH, prefill.DECODE_KV_LEN, "NHD", E4M3)
    cache16 = tuple(c.to(DTYPE) for c in table.cache)  # exact
    return [measure_decode(path, table, cache16, group, args, copy_gbps, peer)
            for path in DECODE_PATHS for group in prefill.DECODE_GROUPS]


# ---------------------------------------------------------------------------------------
# report


def _shape_cells(batch: int, length: int, head_dim: int, causal: bool) -> str:
    h = prefill.Heads.for_head_dim(head_dim)
    return f"| {batch} x {length} | {head_dim} ({h.qo}/{h.kv}) | {'yes' if causal else 'no'} |"


def prefill_table(rows: list[PrefillRow]) -> list[str]:
    lines = [f"Prefill, fa3 e4m3 q/k/v (scales q {SCALES.q:g}, k {SCALES.k:g}, v {SCALES.v:g}) -> bf16 o:", "",
             "| batch x len | head dim (q/kv heads) | causal | fp8 paged TFLOP/s | fp8 ragged TFLOP/s | "
             "bf16 ragged TFLOP/s | SDPA cuDNN bf16 TFLOP/s | fp8 / bf16 (ragged) | fp8 ragged / cuDNN | "
             "rel L2 vs bf16 | max abs vs bf16 | FlashInfer fp8 paged / ragged TFLOP/s | notes |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"{_shape_cells(r.batch, r.length, r.head_dim, r.causal)} "
                     f"{r.fp8_paged_tflops:.1f} | {r.fp8_ragged_tflops:.1f} | {r.bf16_ragged_tflops:.1f} | "
                     f"{_fmt(r.cudnn_tflops)} | {r.fp8_vs_bf16:.2f} | {_fmt(r.fp8_vs_cudnn, '.2f')} | "
                     f"{r.rel_l2:.2e} | {r.max_abs:.2e} | {_fmt(r.flashinfer_fp8_paged_tflops)} / "
                     f"{_fmt(r.flashinfer_fp8_ragged_tflops)} | {r.notes} |")
    return lines


def fp8_kv_prefill_table(rows: list[Fp8KvPrefillRow]) -> list[str]:
    lines = [f"Prefill, fa2, bf16 q over an e4m3 KV cache (k_scale {SCALES.k:g}, v_scale {SCALES.v:g}) -> bf16 o:", "",
             "| batch x len | head dim (q/kv heads) | causal | fp8-KV paged TFLOP/s | fp8-KV ragged TFLOP/s | "
             "bf16 ragged TFLOP/s | fp8-KV / bf16 (ragged) | rel L2 vs bf16 | max abs vs bf16 | "
             "FlashInfer fp8-KV paged / ragged TFLOP/s | notes |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"{_shape_cells(r.batch, r.length, r.head_dim, r.causal)} "
                     f"{r.fp8_kv_paged_tflops:.1f} | {r.fp8_kv_ragged_tflops:.1f} | {r.bf16_ragged_tflops:.1f} | "
                     f"{r.fp8_kv_vs_bf16:.2f} | {r.rel_l2:.2e} | {r.max_abs:.2e} | "
                     f"{_fmt(r.flashinfer_fp8_kv_paged_tflops)} / {_fmt(r.flashinfer_fp8_kv_ragged_tflops)} | {r.notes} |")
    return lines


def decode_table(rows: list[DecodeRow], copy_gbps: float) -> list[str]:
    lines = [f"Decode, batch {prefill.DECODE_BATCH} x kv {prefill.DECODE_KV_LEN}, {decode.NUM_KV_HEADS} kv heads, "
             f"hd {decode.HEAD_DIM}, page {decode.PAGE_SIZE}, e4m3 vs bf16 KV (copy bandwidth {copy_gbps:.0f} GB/s):",
             "", "| path | group | bf16 KV (µs) | % copy BW | fp8 KV (µs) | % copy BW | fp8 speed-up | "
             "rel L2 vs bf16 | max abs vs bf16 | FlashInfer bf16 KV (µs) | FlashInfer fp8 KV (µs) | notes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r.path} | {r.group} | {r.bf16_us:.1f} | {r.bf16_pct_copy_bw:.1f} | {r.fp8_us:.1f} | "
                     f"{r.fp8_pct_copy_bw:.1f} | {r.speedup:.2f} | {r.rel_l2:.2e} | {r.max_abs:.2e} | "
                     f"{_fmt(r.flashinfer_bf16_us)} | {_fmt(r.flashinfer_fp8_us)} | {r.notes} |")
    return lines


def markdown(rows: list[PrefillRow], decode_results: list[DecodeRow], copy_gbps: float,
             fp8_kv_rows: list[Fp8KvPrefillRow] = ()) -> str:
    tables = []
    if rows:
        tables.append(prefill_table(rows))
    if fp8_kv_rows:
        tables.append(fp8_kv_prefill_table(fp8_kv_rows))
    if decode_results:
        tables.append(decode_table(decode_results, copy_gbps))
    return "\n\n".join("\n".join(lines) for lines in tables)


def config(args, peer: _peers.Peer | None = None) -> dict:
    """What the JSON record says about the problems and the method."""
    heads = {str(dim): dict(zip(("num_qo_heads", "num_kv_heads"), prefill.HEADS_BY_HEAD_DIM[dim]))
             for dim in args.head_dims}
    return dict(fp8_dtype="e4m3", o_dtype="bf16", scales=asdict(SCALES), heads_by_head_dim=heads,
                page_size=prefill.PAGE_SIZE, iters=args.iters, warmup=args.warmup, settle_s=SETTLE_SECONDS,
                max_rel_l2=MAX_REL_L2, timer="CUDA events per call, median",
                flops="4 * B * L^2 * Hq * D, halved for causal, for every dtype",
                peers="our bf16 kernels and torch SDPA cuDNN bf16 on the dequantized values; FlashInfer on the fp8 "
                      "tensors themselves, through the same calls as ours",
                flashinfer=peer.config() if peer else None,
                decode=dict(batch=prefill.DECODE_BATCH, kv_len=prefill.DECODE_KV_LEN, num_kv_heads=decode.NUM_KV_HEADS,
                            head_dim=decode.HEAD_DIM, page_size=decode.PAGE_SIZE, groups=list(prefill.DECODE_GROUPS)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attnforge bench fp8: needs a CUDA device", file=sys.stderr)
        return 2
    peer = _peers.Peer.from_args(args)
    warm_peer(peer, args)
    try:
        rows = prefill_rows(args, peer)
        kv_rows = fp8_kv_prefill_rows(args, peer)
        copy_gbps = copy_bandwidth_gbps()
        decode_results = [] if args.no_decode else decode_rows(args, copy_gbps, peer)
    except AssertionError as exc:
        print(f"CORRECTNESS CHECK FAILED, not timing: {exc}", file=sys.stderr)
        return 1
    print(markdown(rows, decode_results, copy_gbps, kv_rows))
    if args.out:
        _record.write(args.out, "fp8", argv, config(args, peer), tables=dict(
            fa3_prefill=[asdict(r) for r in rows], fa2_fp8_kv_prefill=[asdict(r) for r in kv_rows],
            decode=[asdict(r) for r in decode_results],
        ), copy_bandwidth_gbps=copy_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
