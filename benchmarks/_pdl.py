"""The PDL case of `attnforge bench decode`: what programmatic dependent launch gains when a serving
step's attention kernels run back to back.

Method: one CUDA graph of RUNS back-to-back run() calls of a CUDA-graph wrapper (as an engine
captures a decode step), captured once with enable_pdl=False and once with True; each graph's replay
is timed with CUDA events (median after the warm-up) and divided by RUNS. Decode: batch 64 x kv 1024
and 4096, bf16, 32 q / 8 kv heads, hd 128, page 16, on CUDA cores, tensor cores fa2 and (sm90)
tensor cores fa3. Prefill: 16 x 1024 fa3 (fa2 off sm90), causal, paged (page 16) and ragged. The two
graphs' outputs must be equal bit for bit (a row notes it otherwise). Without PDL (before sm90) the
flag is off in both graphs and the ratio is ~1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._timing import graph_of, time_cuda_us

RUNS = 32
DECODE_BATCH, DECODE_KV_LENS = 64, (1024, 4096)
PREFILL_BATCH, PREFILL_LEN = 16, 1024
# CUDA-graph wrappers size split-KV partials for their largest plan: 16 x 1024 fa3 prefill needs ~283 MB.
WORKSPACE_BYTES = 512 << 20


@dataclass
class PdlRow:
    kind: str  # decode or prefill
    path: str  # cuda_cores, tensor_cores_fa2, tensor_cores_fa3; prefill: fa3 paged / fa3 ragged
    batch: int
    kv_len: int
    runs: int
    off_us: float  # per run, a graph of `runs` back-to-back runs without PDL
    on_us: float  # the same with PDL
    speedup: float  # off_us / on_us
    notes: str = ""


def _sm90() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def _row(kind: str, path: str, batch: int, kv_len: int, make_run, args) -> PdlRow:
    """make_run(enable_pdl) -> (run, out); the two graphs are timed and their outputs compared."""
    timings, outputs = {}, {}
    for pdl in (False, True):
        run, out = make_run(pdl)
        graph = graph_of(run, args.pdl_runs)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        outputs[pdl] = out.clone()
        timings[pdl] = time_cuda_us(graph.replay, args.iters, args.warmup) / args.pdl_runs
        del graph
    notes = "" if torch.equal(outputs[False], outputs[True]) else "outputs with and without PDL differ"
    if not _sm90():
        notes = "; ".join(filter(None, [notes, "no PDL before sm90: both graphs run without it"]))
    return PdlRow(kind, path, batch, kv_len, args.pdl_runs, timings[False], timings[True],
                  timings[False] / timings[True], notes)


def decode_rows(args) -> list[PdlRow]:
    import attnforge

    from .decode import DTYPE, HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, PAGE_SIZE, make_problem

    paths = {"cuda_cores": dict(use_tensor_cores=False), "tensor_cores_fa2": dict(use_tensor_cores=True, backend="fa2")}
    if _sm90():
        paths["tensor_cores_fa3"] = dict(use_tensor_cores=True, backend="fa3")
    rows = []
    for kv_len in DECODE_KV_LENS:
        problem = make_problem(DECODE_BATCH, kv_len, "NHD")
        for path, options in paths.items():
            def make_run(pdl, options=options, problem=problem):
                batch = DECODE_BATCH
                wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
                    torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                    paged_kv_indices_buffer=torch.empty(problem.indices.numel(), dtype=torch.int32, device="cuda"),
                    paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device="cuda"), **options)
                wrapper.plan(problem.indptr, problem.indices, problem.last_page_len, NUM_QO_HEADS, NUM_KV_HEADS,
                             HEAD_DIM, PAGE_SIZE, q_data_type=DTYPE, kv_data_type=DTYPE)
                out = torch.empty_like(problem.q)
                return (lambda: wrapper.run(problem.q, problem.cache, out=out, enable_pdl=pdl)), out

            rows.append(_row("decode", path, DECODE_BATCH, kv_len, make_run, args))
        del problem
        torch.cuda.empty_cache()
    return rows


def prefill_rows(args) -> list[PdlRow]:
    import attnforge

    from .prefill import ACCEPTANCE as h
    from .prefill import PAGE_SIZE, make_problem

    backend = "fa3" if _sm90() else "fa2"
    problem = make_problem(PREFILL_BATCH, PREFILL_LEN)
    rows = []
    for paged in (True, False):
        def make_run(pdl, paged=paged, problem=problem):
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
            out = torch.empty(problem.q.shape, dtype=problem.q.dtype, device="cuda")
            if paged:
                wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(
                    workspace, use_cuda_graph=True, backend=backend,
                    paged_kv_indices_buf=torch.empty(problem.page_ids.numel(), dtype=torch.int32, device="cuda"))
                wrapper.plan(problem.qo_indptr, problem.page_indptr, problem.page_ids, problem.last_page_len, h.qo,
                             h.kv, h.dim, PAGE_SIZE, causal=True, q_data_type=problem.q.dtype)
                return (lambda: wrapper.run(problem.q, problem.cache, out=out, enable_pdl=pdl)), out
            wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, use_cuda_graph=True, backend=backend)
            wrapper.plan(problem.qo_indptr, problem.qo_indptr, h.qo, h.kv, h.dim, causal=True,
                         q_data_type=problem.q.dtype)
            return (lambda: wrapper.run(problem.q, problem.k, problem.v, out=out, enable_pdl=pdl)), out

        rows.append(_row("prefill", f"{backend} {'paged' if paged else 'ragged'}", PREFILL_BATCH, PREFILL_LEN,
                         make_run, args))
    del problem
    torch.cuda.empty_cache()
    return rows


def config(args) -> dict:
    """What the record says about the PDL case."""
    return dict(runs=args.pdl_runs, decode_batch=DECODE_BATCH, decode_kv_lens=list(DECODE_KV_LENS),
                prefill_batch=PREFILL_BATCH, prefill_len=PREFILL_LEN, prefill_causal=True,
                method=f"one CUDA graph of {args.pdl_runs} back-to-back run() calls (CUDA-graph wrappers), "
                       "enable_pdl False vs True, replay time / runs")


def markdown(rows: list[PdlRow]) -> str:
    lines = ["| kind | path | batch | kv len | no PDL (µs/run) | PDL (µs/run) | speed-up | notes |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r.kind} | {r.path} | {r.batch} | {r.kv_len} | {r.off_us:.2f} | {r.on_us:.2f} | {r.speedup:.3f} | "
              f"{r.notes} |" for r in rows]
    return "\n".join(lines)
