"""Render docs/benchmarks.md from benchmark JSON: one section per workload family, each table with its
run's date, GPU and commit, the same-run peers and the ratios.

    attnforge bench report bench-build.json bench-decode.json bench-prefill.json bench-fp8.json \\
        [--output docs/benchmarks.md]

The JSON files are what `attnforge bench {build,decode,prefill,fp8} --out F.json` writes (one of each at
most, in any order). The output is a function of their contents and file names only (no clock, no
paths), so the same files always give the same text. A family whose file is not given is left out,
with a note on stderr. Exit status 2 for a file that is not such a record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from . import _record

BENCHMARKS = ("build", "decode", "prefill", "fp8")  # the order of the header's file list
WIDTH = 100
BACKEND_NAMES = {"fa2": "fa2 (mma.sync)", "fa3": "fa3 (wgmma, TMA)"}
LAYOUTS = ("paged", "ragged")


@dataclass(frozen=True)
class Run:
    file: str  # base name, as the header lists it
    doc: dict

    def __getitem__(self, key):
        return self.doc[key]

    def table(self, name: str) -> list[dict]:
        return self.doc["tables"].get(name, [])


class ReportError(Exception):
    """A file that is not a benchmark record this report understands."""


def load(paths: list[str]) -> dict[str, Run]:
    runs = {}
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ReportError(f"{path}: {exc}") from None
        name = doc.get("benchmark") if isinstance(doc, dict) else None
        if name not in BENCHMARKS or doc.get("schema") != _record.SCHEMA or "tables" not in doc:
            raise ReportError(f"{path}: not a schema-{_record.SCHEMA} record of one of {', '.join(BENCHMARKS)} "
                              "(written by `attnforge bench NAME --out`)")
        if name in runs:
            raise ReportError(f"{path}: a second {name} record (first: {runs[name].file})")
        runs[name] = Run(os.path.basename(path), doc)
    return runs


# ---------------------------------------------------------------------------------------
# cells


def num(x, spec: str = ".1f") -> str:
    return "n/a" if x is None else "NaN" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def faster(ours, peer, spec: str = ".2f", times: bool = False) -> str:
    """How many times faster ours is than peer: a rate ratio, or the inverse ratio of times."""
    if not ours or not peer:
        return "n/a"
    return format(peer / ours if times else ours / peer, spec)


def table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table; the first `left` columns left-aligned, the rest right-aligned (numbers)."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    return [f"| {' | '.join(cells)} |" for cells in (header, align, *rows)]


def shape(r: dict, run: Run) -> list[str]:
    """The batch x len, head dim (q/kv heads) and causal cells of a prefill row."""
    h = run["config"]["heads_by_head_dim"][str(r["head_dim"])]
    return [f"{r['batch']} x {r['length']}", f"{r['head_dim']} ({h['num_qo_heads']}/{h['num_kv_heads']})",
            "yes" if r["causal"] else "no"]


def label(r: dict) -> str:
    """A prefill row named in a note."""
    return f"{r['batch']} x {r['length']} hd {r['head_dim']}" + (" causal" if r["causal"] else "")


def run_line(run: Run) -> str:
    date = run["date"].replace("T", " ").rstrip("Z")[:16]
    commit = run["commit"] if run["commit"] == "unknown" else f"`{run['commit'][:10]}`"
    return (f"Run `{run.file}`: {date} UTC, {run['gpu']}, commit {commit}, attnforge {run['attnforge_version']}, "
            f"torch {run['torch']}, CUDA {run['cuda']}.")


def notes(rows: list[dict], label) -> list[str]:
    found = [f"- {label(r)}: {r['notes']}" for r in rows if r.get("notes")]
    return ["", "Notes:", *found] if found else []


def worst(values) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def peer_sentence(run: Run, rows: list[dict], error: str = "", what: str = "") -> str:
    """The FlashInfer peer of a table in one sentence (empty for records from before the peer): its
    version and method, its worst rows[error] against ours (what: how that error is measured), or why
    it did not run."""
    peer = run["config"].get("flashinfer")
    if not peer:
        return ""
    if peer["version"] is None:
        return f" FlashInfer: {peer['note']}."
    err = worst(r.get(error) for r in rows) if error else None
    return (f" FlashInfer {peer['version']}: {peer['method']}" + (f" (its outputs within {what} {num(err, '.1e')})"
                                                                    if err is not None else "")
            + "; n/a: a call it refused, the reason in the notes.")


def peer_columns(rows: list[dict], columns: list[tuple[str, str, str]], times: bool = False):
    """FlashInfer's cells beside ours, when the rows have them (records from before the peer do not):
    (header, cells(row)); columns are (what, our field, FlashInfer's field). The ratios are ours over
    FlashInfer's speed."""
    if not any(theirs in r for r in rows for _, _, theirs in columns):
        return [], lambda r: []
    unit = "µs" if times else "TFLOP/s"
    header = ([f"FlashInfer {what} ({unit})" for what, _, _ in columns]
              + [f"{what}: ours / FlashInfer" for what, _, _ in columns])

    def cells(r: dict) -> list[str]:
        return ([num(r.get(theirs)) for _, _, theirs in columns]
                + [faster(r[ours], r.get(theirs), times=times) for _, ours, theirs in columns])
    return header, cells


# ---------------------------------------------------------------------------------------
# the families


def decode_section(runs: dict[str, Run]) -> list[str]:
    """bench decode's table and plan() times, then bench prefill's CUDA-core vs tensor-core decode."""
    parts = []
    if "decode" in runs:
        parts.append(decode_table(runs["decode"]))
        if runs["decode"].table("pdl"):
            parts.append(pdl_table(runs["decode"]))
    if "prefill" in runs and runs["prefill"].table("tensor_core_decode"):
        parts.append(tensor_core_table(runs["prefill"]))
    return [line for i, part in enumerate(parts) for line in [""] * (i > 0) + part]


def decode_table(run: Run) -> list[str]:
    c, rows = run["config"], run.table("decode")
    fp8_rows = any(r["kv_dtype"] != "bf16" for r in rows)
    # records from before --head-dims have no head_dim in their rows: the config's
    head_dims = sorted({r.get("head_dim", c["head_dim"]) for r in rows}) or [c["head_dim"]]
    by_hd = len(head_dims) > 1

    def head_dim_of(r: dict) -> int:
        return r.get("head_dim", c["head_dim"])

    def hd(r: dict) -> str:
        return f" hd {head_dim_of(r)}" if by_hd else ""

    checks = "; ".join(f"{k['kv_dtype']} KV {k['batch']} x {k['kv_len']}{hd(k)}: max abs {num(k['max_abs'], '.1e')}, "
                       f"rel L2 {num(k['rel_l2'], '.1e')}" for k in run.table("check"))
    peer_err = worst(r.get(f"{p}_max_abs_vs_ours") for r in rows for p in ("cudnn", "flash"))
    timing = f"Timing: {c['timer']}. " if "graph_runs" in c else ""  # records from before graph timing: eager
    same = any(r.get("copy_us") is not None for r in rows)  # records from before the same-bytes copy have none
    lines = [run_line(run), "",
             f"Batch decode, {c['dtype']} q, {c['num_qo_heads']} q / {c['num_kv_heads']} kv heads, hd "
             f"{'by row' if by_hd else head_dims[0]}, page {c['page_size']}, {c['layout']}, every request `kv len` "
             f"tokens on pages scattered at random. {timing}GB/s counts {c['bytes']} once; copy bandwidth "
             f"{num(run['copy_bandwidth_gbps'], '.0f')} GB/s ({c['copy']})"
             + (f"; copy of the same bytes: {c['same_bytes_copy']} (the bandwidth-bound time at that size, launch "
                "and ramp included)" if same else "") + ". SDPA runs on a dense bf16 cache of the "
             "same contents" + (f" (its outputs within {num(peer_err, '.1e')} max abs of ours)" if peer_err else "")
             + (f". Checked against attnforge.reference before timing ({checks})" if checks else "") + "."
             + peer_sentence(run, rows, "flashinfer_max_abs_vs_ours", "max abs"), ""]
    peer_header, peer_cells = peer_columns(rows, [("CUDA cores", "us", "flashinfer_us"),
                                                  ("tensor cores", "tc_us", "flashinfer_tc_us")], times=True)
    tc = any(r.get("tc_us") is not None for r in rows)
    header = (["kv dtype"] + ["head dim"] * by_hd + ["batch", "kv len", "ours (µs)", "GB/s", "% copy BW"]
              + ["ours tensor cores (µs)", "tensor cores % copy BW"] * tc + ["copy of the same bytes (µs)"] * same
              + ["SDPA cuDNN (µs)", "SDPA FLASH (µs)", "speed-up vs cuDNN", "speed-up vs FLASH"]
              + ["speed-up vs bf16 KV"] * fp8_rows + peer_header)

    def cells(r: dict) -> list[str]:
        return ([r["kv_dtype"]] + [str(head_dim_of(r))] * by_hd
                + [str(r["batch"]), str(r["kv_len"]), num(r["us"]), num(r["gbps"], ".0f"), num(r["pct_copy_bw"])]
                + [num(r.get("tc_us")), num(r.get("tc_pct_copy_bw"))] * tc + [num(r.get("copy_us"))] * same
                + [num(r["cudnn_us"]), num(r["flash_us"]), faster(r["us"], r["cudnn_us"], ".3f", times=True),
                   faster(r["us"], r["flash_us"], ".3f", times=True)]
                + [num(r["speedup_vs_bf16_kv"], ".2f")] * fp8_rows + peer_cells(r))

    body = [cells(r) for r in rows]
    lines += table(header, body) + notes(rows, lambda r: f"{r['kv_dtype']} {r['batch']} x {r['kv_len']}{hd(r)}")
    plans = run.table("plan")
    if plans:
        lines += ["", f"plan() host time, median of {plans[0]['calls']} calls at kv len {plans[0]['kv_len']}: "
                  + ", ".join(f"batch {p['batch']} {num(p['us'])} µs" for p in plans) + "."]
    return lines + sinks_lines(run) + overhead_lines(run)


def sinks_lines(run: Run) -> list[str]:
    """What attention sinks cost ours, when measured: the same wrapper and timer without and with them."""
    rows, c = run.table("sinks"), run["config"].get("sinks")
    if not rows or not c:
        return []
    lines = ["", f"Attention sinks (gpt-oss; run(..., sinks=s), s {c['sinks']}), batch {c['batch']} x kv "
             f"{c['kv_len']}, hd {c['head_dim']}, {c['kv_dtype']} KV: ours timed without and with sinks, the same "
             "wrapper and timer; without / with at least 0.97 is sinks costing at most 3% (issue 38).", ""]
    body = [[r["path"], num(r["us"]), num(r["sinks_us"]), num(r["ratio"], ".3f")] for r in rows]
    return (lines + table(["decode path", "without sinks (µs)", "with sinks (µs)", "without / with"], body)
            + notes(rows, lambda r: f"sinks {r['path']}"))


def overhead_lines(run: Run) -> list[str]:
    """run()'s host overhead, ours and FlashInfer's from the same process, when measured."""
    rows = run.table("overhead")
    if not rows:
        return []
    note = run.doc.get("overhead_note") or ""
    lines = ["", f"run() host overhead, batch {rows[0]['batch']} x kv {rows[0]['kv_len']}: back-to-back eager calls "
             "against replays of a CUDA graph of the same call (µs per call, median of 7 loops of 200 calls); "
             "overhead = eager - graph, the host time run() adds above the kernel; host clock = the CPU time of one "
             "call" + (f". {note}" if note else "") + ".", ""]
    body = [[r["library"], r["path"], num(r["eager_us"]), num(r["graph_us"]), num(r["overhead_us"]), num(r["host_us"])]
            for r in rows]
    return lines + table(["library", "decode path", "eager (µs)", "graph replay (µs)", "overhead (µs)",
                          "host clock (µs)"], body, left=2)


def pdl_table(run: Run) -> list[str]:
    """bench decode's PDL case: graphs of back-to-back runs without and with programmatic dependent launch."""
    c, rows = run["config"]["pdl"], run.table("pdl")
    lines = [run_line(run), "",
             f"Programmatic dependent launch (`enable_pdl`): {c['method']}. Decode batch {c['decode_batch']}, "
             f"bf16, {run['config']['num_qo_heads']} q / {run['config']['num_kv_heads']} kv heads, hd "
             f"{run['config']['head_dim']}, page {run['config']['page_size']}; prefill {c['prefill_batch']} x "
             f"{c['prefill_len']}" + (" causal" if c["prefill_causal"] else "") + ". Speed-up: µs per run without "
             "PDL over with it.", ""]
    header = ["kind", "path", "batch", "kv len", "no PDL (µs/run)", "PDL (µs/run)", "speed-up"]
    body = [[r["kind"], r["path"].replace("_", " "), str(r["batch"]), str(r["kv_len"]), num(r["off_us"], ".2f"),
             num(r["on_us"], ".2f"), faster(r["on_us"], r["off_us"], ".3f", times=True)] for r in rows]
    return lines + table(header, body, left=2) + notes(rows, lambda r: f"{r['kind']} {r['path']} {r['kv_len']}")


def tensor_core_table(run: Run) -> list[str]:
    d, rows = run["config"]["decode"], run.table("tensor_core_decode")
    names = {"cuda_cores": "CUDA cores", **{f"tensor_cores_{b}": f"tensor cores {b}" for b in BACKEND_NAMES}}
    lines = [run_line(run), "",
             f"CUDA-core vs tensor-core decode, batch {d['batch']} x kv {d['kv_len']}, {d['num_kv_heads']} kv heads, "
             f"hd {d['head_dim']}, bf16, page {run['config']['page_size']}, by GQA group; copy bandwidth "
             f"{num(run['copy_bandwidth_gbps'], '.0f')} GB/s; max abs diff: the paths' outputs against the CUDA "
             "cores'." + peer_sentence(run, rows), ""]
    peer_header, peer_cells = peer_columns(rows, [(names.get(p, p), f"{p}_us", f"flashinfer_{p}_us")
                                                  for p in d["paths"]], times=True)
    header = ["GQA group"] + [h for p in d["paths"] for h in (f"{names.get(p, p)} (µs)", "% copy BW")]
    body = [[str(r["group"])] + [num(r[f"{p}_{u}"]) for p in d["paths"] for u in ("us", "pct_copy_bw")]
            + [num(r["max_abs_diff"], ".1e")] + peer_cells(r) for r in rows]
    return (lines + table(header + ["max abs diff"] + peer_header, body)
            + notes(rows, lambda r: f"GQA group {r['group']}"))


def prefill_section(run: Run, backend: str) -> list[str]:
    c = run["config"]
    rows = [r for r in run.table("prefill") if backend == "fa2" or r.get("fa3_ragged_tflops") is not None]
    if backend not in c["backends"] or not rows:
        return []
    ours = {"fa2": ("paged_tflops", "ragged_tflops"), "fa3": ("fa3_paged_tflops", "fa3_ragged_tflops")}[backend]
    # the peer of its generation first: FLASH (FlashAttention-2) for fa2, cuDNN for fa3
    peers = [("flash", "FLASH"), ("cudnn", "cuDNN")][:: 1 if backend == "fa2" else -1]
    checks = [k for k in run.table("check") if k["backend"] == backend]
    peer_err = worst(r.get(f"{p}_rel_l2_vs_ours") for r in rows for p, _ in peers)
    spread = worst(r.get("ours_max_abs_spread") for r in rows)
    lines = [run_line(run), "",
             f"Batch prefill on {BACKEND_NAMES[backend]}, {c['dtype']}, every request L query tokens over the "
             f"same L kv tokens, paged (page {c['page_size']}, pages scattered at random) and ragged; TFLOP/s "
             f"counts {c['flops']}. SDPA runs on dense tensors of the same contents"
             + (f" (its outputs within relative L2 {num(peer_err, '.1e')} of our fa2 ragged one)"
                if peer_err is not None else "")
             + (f"; our fa2 and fa3, paged and ragged outputs agree within max abs {num(spread, '.1e')}"
                if spread is not None else "")
             + (f". Checked against attnforge.reference before timing ({c['check_shape']}, paged and ragged, causal "
                f"and not): max abs {num(worst(k['max_abs'] for k in checks), '.1e')}" if checks else "") + "."
             + peer_sentence(run, rows, "flashinfer_rel_l2_vs_ours", "relative L2 of ours"), ""]
    theirs = {"fa2": "flashinfer_{}_tflops", "fa3": "flashinfer_fa3_{}_tflops"}[backend]
    peer_header, peer_cells = peer_columns(rows, [(layout, field, theirs.format(layout))
                                                  for layout, field in zip(LAYOUTS, ours)])
    header = ["batch x len", "head dim (q/kv heads)", "causal", "paged TFLOP/s", "ragged TFLOP/s"]
    header += [f"SDPA {label} TFLOP/s" for _, label in peers]
    header += [f"ragged / {label}" for _, label in peers] + ["paged / ragged"] + peer_header
    body = [shape(r, run) + [num(r[ours[0]]), num(r[ours[1]])] + [num(r[f"{p}_tflops"]) for p, _ in peers]
            + [faster(r[ours[1]], r[f"{p}_tflops"]) for p, _ in peers] + [faster(r[ours[0]], r[ours[1]])]
            + peer_cells(r) for r in rows]
    return lines + table(header, body, left=3) + notes(rows, label)


# Issue 38's targets for a head dim: its FLOP rate at least this much of the next larger head dim's (same
# backend), and at least cuDNN's where cuDNN runs it.
NEXT_LARGER_TARGET = 0.9
PAGED_FIELDS = {"fa2": "paged_tflops", "fa3": "fa3_paged_tflops"}


def next_larger(rows: list[dict], r: dict, field: str) -> dict | None:
    """The row of the smallest head dim above r's among rows of r's shape and causal flag that have a value
    in `field` (a backend refused at a dim is skipped), or None."""
    larger = [o for o in rows if (o["batch"], o["length"], o["causal"]) == (r["batch"], r["length"], r["causal"])
              and o["head_dim"] > r["head_dim"] and o.get(field) is not None]
    return min(larger, key=lambda o: o["head_dim"], default=None)


def head_dim_section(run: Run) -> list[str]:
    """One table per shape the record ran at more than one head dim: our paged prefill per head dim and
    causal flag, beside SDPA cuDNN and beside the next larger head dim of the same backend."""
    rows = run.table("prefill")
    backends = [b for b in PAGED_FIELDS if b in run["config"]["backends"]]
    lines = []
    for batch, length in dict.fromkeys((r["batch"], r["length"]) for r in rows):
        group = sorted((r for r in rows if (r["batch"], r["length"]) == (batch, length)),
                       key=lambda r: (r["causal"], r["head_dim"]))
        if len({r["head_dim"] for r in group}) < 2:
            continue
        header = ["head dim (q/kv heads)", "causal", "SDPA cuDNN TFLOP/s"] + [
            h for b in backends for h in (f"{b} paged TFLOP/s", f"{b} / cuDNN", f"{b} vs next larger")]
        body = []
        for r in group:
            cells = shape(r, run)[1:] + [num(r["cudnn_tflops"])]
            for b in backends:
                ours, bigger = r.get(PAGED_FIELDS[b]), next_larger(group, r, PAGED_FIELDS[b])
                cells += [num(ours), faster(ours, r["cudnn_tflops"]),
                          faster(ours, bigger[PAGED_FIELDS[b]] if bigger else None)]
            body.append(cells)
        lines += [*([""] * bool(lines)), run_line(run), "",
                  f"Prefill at {batch} x {length} by head dim, paged: our TFLOP/s beside SDPA cuDNN's at the same "
                  "head dim, and over the TFLOP/s of the next larger head dim in this run on the same backend (a "
                  "FLOP rate: the comparison scaled by FLOPs). Targets (issue 38): vs next larger at least "
                  f"{NEXT_LARGER_TARGET}, and ours / cuDNN at least 1 where cuDNN runs; n/a: a kernel the rules "
                  "refuse, or a peer that refused (the reason in the FA2 prefill notes), or no larger head dim.", ""]
        lines += table(header, body, left=2)
    return lines


def sinks_section(run: Run) -> list[str]:
    """bench prefill's sinks table: paged prefill without and with attention sinks on one wrapper."""
    rows = run.table("sinks")
    if not rows:
        return []
    c, r0 = run["config"].get("sinks") or {}, rows[0]
    lines = [run_line(run), "",
             f"Attention sinks (gpt-oss): paged prefill at {r0['batch']} x {r0['length']}, hd {r0['head_dim']}, "
             f"{run['config']['dtype']}, run() against run(sinks=s)" + (f", s = {c['logits']}" if "logits" in c else "")
             + (f"; {c['method']}" if "method" in c else "") + ". without / with: the time without sinks over the "
             f"time with them; target at least {c.get('target', 0.97)} (sinks cost at most 3%). max abs: how far "
             "the sinks moved the output (above 0: they were applied).", ""]
    body = [[r["backend"], "yes" if r["causal"] else "no", num(r["no_sinks_us"]), num(r["sinks_us"]),
             num(r["no_sinks_over_sinks"], ".3f"), num(r["max_abs_vs_no_sinks"], ".1e")] for r in rows]
    header = ["backend", "causal", "without sinks (µs)", "with sinks (µs)", "without / with", "max abs vs no sinks"]
    return (lines + table(header, body, left=2)
            + notes(rows, lambda r: r["backend"] + (" causal" if r["causal"] else "")))


def fp8_section(run: Run) -> list[str]:
    c = run["config"]
    s = c["scales"]
    lines = [run_line(run)]
    rows = run.table("fa3_prefill")
    if rows:
        lines += ["", f"fa3 prefill, e4m3 q/k/v (scales q {s['q']:g}, k {s['k']:g}, v {s['v']:g}) -> bf16 o, "
                  f"against our fa3 bf16 and SDPA cuDNN bf16 on the dequantized values (exact in bf16); TFLOP/s "
                  f"counts {c['flops']}; rel L2 = the fp8 output against the bf16 one (the worse of paged and "
                  "ragged); fp8 vs next larger: the fp8 paged FLOP rate over that of the next larger head dim in "
                  f"this run (issue 38: at least {NEXT_LARGER_TARGET})."
                  + peer_sentence(run, rows, "flashinfer_rel_l2_vs_bf16", "relative L2 of our bf16 one"), ""]
        peer_header, peer_cells = peer_columns(rows, [(f"fp8 {layout}", f"fp8_{layout}_tflops",
                                                       f"flashinfer_fp8_{layout}_tflops") for layout in LAYOUTS])
        header = ["batch x len", "head dim (q/kv heads)", "causal", "fp8 paged TFLOP/s", "fp8 ragged TFLOP/s",
                  "bf16 ragged TFLOP/s", "SDPA cuDNN bf16 TFLOP/s", "fp8 / bf16", "fp8 / cuDNN", "fp8 vs next larger",
                  "rel L2 vs bf16"]
        body = []
        for r in rows:
            bigger = next_larger(rows, r, "fp8_paged_tflops")
            body.append(shape(r, run) + [
                num(r["fp8_paged_tflops"]), num(r["fp8_ragged_tflops"]), num(r["bf16_ragged_tflops"]),
                num(r["cudnn_tflops"]), faster(r["fp8_ragged_tflops"], r["bf16_ragged_tflops"]),
                faster(r["fp8_ragged_tflops"], r["cudnn_tflops"]),
                faster(r["fp8_paged_tflops"], bigger["fp8_paged_tflops"] if bigger else None),
                num(r["rel_l2"], ".2e")] + peer_cells(r))
        header += peer_header
        lines += table(header, body, left=3) + notes(rows, label)
    rows = run.table("fa2_fp8_kv_prefill")
    if rows:
        lines += ["", f"fa2 prefill, bf16 q over an e4m3 KV cache (k_scale {s['k']:g}, v_scale {s['v']:g}) against "
                  "the bf16 cache of the same values; ratios and rel L2 of the ragged run."
                  + peer_sentence(run, rows, "flashinfer_rel_l2_vs_bf16", "relative L2 of our bf16 one"), ""]
        peer_header, peer_cells = peer_columns(rows, [(f"fp8-KV {layout}", f"fp8_kv_{layout}_tflops",
                                                       f"flashinfer_fp8_kv_{layout}_tflops") for layout in LAYOUTS])
        header = ["batch x len", "head dim (q/kv heads)", "causal", "fp8-KV paged TFLOP/s", "fp8-KV ragged TFLOP/s",
                  "bf16 ragged TFLOP/s", "fp8-KV / bf16", "rel L2 vs bf16"] + peer_header
        body = [shape(r, run) + [num(r["fp8_kv_paged_tflops"]), num(r["fp8_kv_ragged_tflops"]),
                            num(r["bf16_ragged_tflops"]), faster(r["fp8_kv_ragged_tflops"], r["bf16_ragged_tflops"]),
                            num(r["rel_l2"], ".2e")] + peer_cells(r) for r in rows]
        lines += table(header, body, left=3) + notes(rows, label)
    rows = run.table("decode")
    if rows:
        d = c["decode"]
        lines += ["", f"Decode, batch {d['batch']} x kv {d['kv_len']}, {d['num_kv_heads']} kv heads, hd "
                  f"{d['head_dim']}, page {d['page_size']}: e4m3 KV against bf16 KV of the same values, by path "
                  f"and GQA group; copy bandwidth {num(run['copy_bandwidth_gbps'], '.0f')} GB/s."
                  + peer_sentence(run, rows), ""]
        peer_header, peer_cells = peer_columns(rows, [(f"{kv} KV", f"{kv}_us", f"flashinfer_{kv}_us")
                                                      for kv in ("bf16", "fp8")], times=True)
        header = ["path", "GQA group", "bf16 KV (µs)", "% copy BW", "fp8 KV (µs)", "% copy BW", "fp8 speed-up",
                  "rel L2 vs bf16"] + peer_header
        body = [[r["path"], str(r["group"]), num(r["bf16_us"]), num(r["bf16_pct_copy_bw"]), num(r["fp8_us"]),
                 num(r["fp8_pct_copy_bw"]), faster(r["fp8_us"], r["bf16_us"], times=True), num(r["rel_l2"], ".2e")]
                + peer_cells(r) for r in rows]
        lines += table(header, body) + notes(rows, lambda r: f"{r['path']} group {r['group']}")
    return lines if len(lines) > 1 else []


def build_section(run: Run) -> list[str]:
    """Cold builds per family against FlashInfer's cold JIT, then the default manifest's `attnforge build`."""
    c, rows = run["config"], run.table("build")
    peer = (f"FlashInfer {c['flashinfer_version']}: {c['flashinfer_what']}" if c["flashinfer_version"]
            else f"FlashInfer: {c['flashinfer_note']}")
    lines = [run_line(run), "",
             f"Cold build of one module per family, each alone: {c['what']}; {c['cpu_count']} CPUs, nvcc: "
             f"{c['nvcc']}. {peer}. Speed-up: FlashInfer's seconds over ours.", ""]
    header = ["module", "arch", "ours (s), incl. process start", "FlashInfer (s), incl. process start",
              "speed-up vs FlashInfer"]
    body = [[r["module"], r["arch"], num(r["cold_build_s"]), num(r["flashinfer_s"]),
             faster(r["cold_build_s"], r["flashinfer_s"], times=True)] for r in rows]
    lines += table(header, body, left=2) + notes(rows, lambda r: f"{r['module']} {r['arch']}")
    return lines + ["", *manifest_lines(run)]


def manifest_lines(run: Run) -> list[str]:
    """The manifest build's totals and per-module table, or why there is none."""
    m = run["config"]["manifest"]
    if m is None:
        return ["The manifest build was not run (--no-manifest)."]
    totals = run.table("manifest_total")
    if not totals:
        return [f"`{m['command']}` did not finish: the run stopped before it ended."]
    t = totals[0]
    lines = [f"`{m['command']}` ({m['name']} manifest, {', '.join(m['archs'])}; {m['parallel']} module builds at "
             f"once on {run['config']['cpu_count']} CPUs): {t['modules']} modules ({t['built']} built, "
             f"{t['failed']} failed) in {num(t['wall_s'])} s of wall time, process start included "
             f"({num(t['build_s'])} s by its own count), exit status {t['exit_code']}"
             + (f"; {t['notes']}." if t["notes"] else ".")]
    if t.get("cpu_s"):  # records before the CPU time was measured have none
        cores = run["config"]["cpu_count"]
        lines[0] += (f" The compilers used {num(t['cpu_s'])} CPU seconds, {t['cpu_s'] / (t['wall_s'] * cores):.0%} of "
                     f"{cores} CPUs over the wall time: the build cannot take less than {num(t['cpu_s'] / cores)} s "
                     "on this host without compiling less.")
    modules = run.table("manifest")
    if modules:
        body = [[r["module"], num(r["seconds"]) if r["status"] == "built" else r["status"], num(r["size_mib"])]
                for r in modules]
        lines += ["", *table(["module", "seconds", "size (MiB)"], body)]
    return lines


def render(runs: dict[str, Run]) -> str:
    files = ", ".join(f"`{runs[n].file}`" for n in BENCHMARKS if n in runs)
    out = ["# Benchmarks", "",
           f"Generated by `attnforge bench report` from {files} (`.ci/gpu-session bench` writes them); do not edit "
           "by hand: rerun the benchmarks and the report. Earlier runs are in this file's git history.", "",
           "Method: CUDA events around each call (or each CUDA-graph replay, where a section's Timing sentence "
           "says so), the median reported, each kernel first run back to back for at "
           "least 0.5 s (timed at the clock the card's power cap leaves it), no L2 flush. Every peer is timed in "
           "the same run on the same contents. Every ratio compares speeds: above 1, the first named is faster "
           "(TFLOP/s over TFLOP/s, or the inverse ratio of times); n/a: a peer that refused or was not run."]
    sections = [("Decode", decode_section(runs))]
    if "prefill" in runs:
        sections += [("FA2 prefill", prefill_section(runs["prefill"], "fa2")),
                     ("FA3 prefill", prefill_section(runs["prefill"], "fa3")),
                     ("Prefill by head dim", head_dim_section(runs["prefill"])),
                     ("Attention sinks", sinks_section(runs["prefill"]))]
    if "fp8" in runs:
        sections.append(("FP8", fp8_section(runs["fp8"])))
    if "build" in runs:
        sections.append(("Build times", build_section(runs["build"])))
    for title, lines in sections:
        if lines:
            out += ["", f"## {title}", "", *lines]
    return "\n".join(wrap(line) for line in out) + "\n"


def wrap(line: str) -> str:
    """Prose at WIDTH columns, as the hand-written docs; tables, headings and notes as they are."""
    if len(line) <= WIDTH or line.startswith(("|", "#", "- ")):
        return line
    return textwrap.fill(line, WIDTH, break_long_words=False, break_on_hyphens=False)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="attnforge bench report", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE.json", help="records written by `attnforge bench NAME --out`")
    p.add_argument("--output", metavar="FILE.md", help="write here (atomically) instead of to stdout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = load(args.files)
    except ReportError as exc:
        print(f"attnforge bench report: error: {exc}", file=sys.stderr)
        return 2
    try:
        text = render(runs)
    except (KeyError, TypeError) as exc:  # a record of an older or newer layout than this report's
        print(f"attnforge bench report: error: a record lacks or mistypes {exc}; rerun its benchmark",
              file=sys.stderr)
        return 2
    for name in BENCHMARKS:
        if name not in runs:
            print(f"attnforge bench report: no {name} record given; its tables are left out", file=sys.stderr)
    if args.output:
        target = Path(args.output)
        temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temp.write_text(text)
        os.replace(temp, target)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
