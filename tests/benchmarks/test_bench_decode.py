"""bench decode's logic without a GPU: graph timing and its eager fallback, the head-dim rows and the
memory skip, the fp8 speed-ups, and the sinks rows, with the timers and the device replaced (CPU)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from attnforge.benchmarks import _decode_problem, decode


def timers(monkeypatch, graph=None):
    """decode's timers replaced: eager calls take 40 µs, graph replays 10 µs per run (or graph raises)."""
    calls = []

    def time_graph_us(run, runs, iters, warmup, flush=None):
        calls.append(("graph", runs))
        if graph is not None:
            raise graph
        return 10.0

    def time_cuda_us(run, iters, warmup, flush=None):
        calls.append(("eager", None))
        return 40.0

    monkeypatch.setattr(decode, "time_graph_us", time_graph_us)
    monkeypatch.setattr(decode, "time_cuda_us", time_cuda_us)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: "default stream")
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: calls.append(("set_stream", stream)))
    return calls


def test_run_calls_are_timed_in_a_graph_by_default(monkeypatch):
    calls = timers(monkeypatch)
    notes = []
    assert decode.timed_us(lambda: None, decode.parse_args([]), None, notes, "ours") == 10.0
    assert calls == [("graph", decode.GRAPH_RUNS)] and notes == []


def test_eager_times_every_call_eager(monkeypatch):
    calls = timers(monkeypatch)
    notes = []
    assert decode.timed_us(lambda: None, decode.parse_args(["--eager"]), None, notes, "ours") == 40.0
    assert calls == [("eager", None)] and notes == []


def test_a_failed_capture_falls_back_to_eager_and_says_why(monkeypatch):
    calls = timers(monkeypatch, graph=RuntimeError("operation not permitted when stream is capturing\nmore"))
    notes = []
    args = decode.parse_args(["--graph-runs", "4"])
    assert decode.timed_us(lambda: None, args, None, notes, "ours tensor cores") == 40.0
    assert calls == [("graph", 4), ("set_stream", "default stream"), ("eager", None)]
    assert notes == ["ours tensor cores timed eager, its CUDA graph capture failed: "
                     "RuntimeError: operation not permitted when stream is capturing"]


def test_head_dims_are_those_of_the_decode_rules():
    assert decode.HEAD_DIM_CHOICES == [64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
    assert decode.parse_args([]).head_dims == [128]
    assert decode.parse_args(["--head-dims", "64", "512"]).head_dims == [64, 512]
    with pytest.raises(SystemExit):
        decode.parse_args(["--head-dims", "100"])


def test_rows_by_head_dim_then_shape_and_what_does_not_fit_is_skipped():
    args = decode.parse_args(["--head-dims", "128", "512", "--batch", "64", "256", "--kv-len", "4096", "16384"])
    free = 130 << 30
    rows, skipped = decode.shapes(args, free)
    assert rows == [(d, b, n) for d in (128, 512) for b in (64, 256) for n in (4096, 16384)]
    # hd 512 at 256 x 16384: 32 GiB per K or V, five of them at make_problem's peak
    assert list(skipped) == [(512, 256, 16384)]
    assert skipped[(512, 256, 16384)] == "skipped: needs ~162 GiB of device memory, 130 GiB free"
    assert decode.problem_bytes(64, 4096, 128) == 5 * (64 * 8 * 4096 * 128 * 2) + _decode_problem.SPARE_BYTES
    assert decode.problem_bytes(1, 1000, 64) == decode.problem_bytes(1, 1008, 64)  # whole pages


def test_more_head_dims_run_at_the_more_shapes_only_after_every_shape_of_the_head_dims():
    args = decode.parse_args(["--batch", "1", "64", "--kv-len", "4096", "--more-head-dims", "80", "128", "512"])
    assert args.more_shapes == [(64, 4096)]
    rows, skipped = decode.shapes(args, 130 << 30)
    # 128 is already timed at every shape: --more-head-dims adds no second row for it
    assert rows == [(128, 1, 4096), (128, 64, 4096), (80, 64, 4096), (512, 64, 4096)] and not skipped
    assert decode.every_head_dim(args) == [128, 80, 512]
    config = decode.config(args)
    assert config["more_head_dims"] == [80, 128, 512] and config["more_shapes"] == ["64 x 4096"]
    with pytest.raises(SystemExit):
        decode.parse_args(["--more-head-dims", "100"])


def test_skipped_rows_are_n_a_and_fp8_speed_ups_pair_rows_of_one_head_dim():
    rows = [decode.Row("bf16", 64, 4096, 200.0, 1.0, 1.0, None, None, None, head_dim=128),
            decode.Row("bf16", 64, 4096, 400.0, 1.0, 1.0, None, None, None, head_dim=256),
            decode.Row("e4m3", 64, 4096, 100.0, 1.0, 1.0, None, None, None, head_dim=128),
            decode.Row("e4m3", 64, 4096, 160.0, 1.0, 1.0, None, None, None, head_dim=256),
            decode.skipped_row("e4m3", 512, 64, 4096, "skipped: too big")]
    decode.add_speedups(rows)
    assert [r.speedup_vs_bf16_kv for r in rows] == [None, None, 2.0, 2.5, None]
    assert rows[-1].us is None and rows[-1].notes == "skipped: too big" and rows[-1].head_dim == 512
    text = decode.markdown(rows, 4000.0, {}, 1.0, decode.parse_args([]))
    assert "| e4m3 | 512 | 64 | 4096 | n/a | n/a | n/a |" in text and "| e4m3 | 256 | 64 | 4096 | 160.0 |" in text


def cpu_problem() -> decode.Problem:
    q = torch.zeros(2, decode.NUM_QO_HEADS, 64, dtype=torch.bfloat16)
    cache = tuple(torch.zeros(3, decode.PAGE_SIZE, decode.NUM_KV_HEADS, 64, dtype=torch.bfloat16) for _ in "kv")
    dense = torch.zeros(2, decode.NUM_KV_HEADS, 16, 64, dtype=torch.bfloat16)
    return decode.Problem(q, cache, torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([2, 0]),
                          torch.tensor([5, 16], dtype=torch.int32), dense, dense)


def test_sinks_rows_time_one_wrapper_without_and_with_sinks(monkeypatch):
    wrappers, sinks = [], []

    def attnforge_decode(problem, layout, tensor_cores=False):
        wrapper = types.SimpleNamespace(tensor_cores=tensor_cores, last=None)
        wrappers.append(wrapper)

        def run(**extra):
            wrapper.last = extra
        return run, None

    def timed_us(run, args, flush, notes, what):
        run()
        wrapper = wrappers[-1]
        if "sinks" in wrapper.last:
            sinks.append(wrapper.last["sinks"])
            return 103.0 if wrapper.tensor_cores else 101.0
        return 100.0

    monkeypatch.setattr(decode, "make_problem", lambda *args, **kwargs: cpu_problem())
    monkeypatch.setattr(decode, "attnforge_decode", attnforge_decode)
    monkeypatch.setattr(decode, "timed_us", timed_us)
    rows = decode.sinks_rows(decode.parse_args([]), None)
    assert len(wrappers) == 2  # one wrapper per path, timed without and with
    assert [(r.path, r.batch, r.kv_len, r.us, r.sinks_us) for r in rows] == [
        ("CUDA cores", 64, 4096, 100.0, 101.0), ("tensor cores", 64, 4096, 100.0, 103.0)]
    assert [r.ratio for r in rows] == pytest.approx([100 / 101, 100 / 103])
    assert all(s.dtype == torch.float32 and s.shape == (decode.NUM_QO_HEADS,) for s in sinks)
    assert torch.equal(sinks[0], sinks[1]) and sinks[0].std() > 0  # the same random sinks for both paths


def test_a_sinks_path_that_raises_is_n_a_with_the_reason(monkeypatch):
    def attnforge_decode(problem, layout, tensor_cores=False):
        if tensor_cores:
            raise ValueError("sinks: not supported\ndetails")
        return (lambda **extra: None), None

    monkeypatch.setattr(decode, "make_problem", lambda *args, **kwargs: cpu_problem())
    monkeypatch.setattr(decode, "attnforge_decode", attnforge_decode)
    monkeypatch.setattr(decode, "timed_us", lambda run, args, flush, notes, what: 50.0)
    rows = decode.sinks_rows(decode.parse_args(["--eager"]), None)
    assert (rows[0].ratio, rows[0].notes) == (1.0, "")
    assert (rows[1].us, rows[1].sinks_us, rows[1].ratio) == (None, None, None)
    assert rows[1].notes == "n/a: ValueError: sinks: not supported"
    assert "| tensor cores | n/a | n/a | n/a | n/a: ValueError: sinks: not supported |" in decode.sinks_markdown(rows)


def test_when_one_of_the_sinks_pair_cannot_be_captured_both_are_timed_eager(monkeypatch):
    timings, extras = [], []

    def timed_us(run, args, flush, notes, what):
        run()
        with_sinks = "sinks" in extras[-1]
        timings.append(("eager" if args.eager else "graph", with_sinks))
        if with_sinks and not args.eager:
            notes.append("with sinks timed eager, its CUDA graph capture failed: RuntimeError: x")
            return 60.0
        return 50.0 if args.eager else 20.0

    monkeypatch.setattr(decode, "make_problem", lambda *args, **kwargs: cpu_problem())
    monkeypatch.setattr(decode, "attnforge_decode",
                        lambda problem, layout, tensor_cores=False: ((lambda **extra: extras.append(extra)), None))
    monkeypatch.setattr(decode, "timed_us", timed_us)
    rows = decode.sinks_rows(decode.parse_args([]), None)
    assert timings == [("graph", False), ("graph", True), ("eager", False), ("eager", True)] * 2
    assert (rows[0].us, rows[0].sinks_us, rows[0].ratio) == (50.0, 50.0, 1.0)
    assert rows[0].notes == "with sinks timed eager, its CUDA graph capture failed: RuntimeError: x"


def test_the_record_says_how_the_rows_were_timed():
    graph = decode.config(decode.parse_args(["--graph-runs", "8", "--head-dims", "64", "128"]))
    assert graph["graph_runs"] == 8 and graph["head_dims"] == [64, 128] and graph["head_dim"] == 128
    assert "one CUDA graph of 8 back-to-back run() calls" in graph["timer"] and "SDPA" in graph["timer"]
    assert graph["sinks"]["batch"] == decode.SINKS_BATCH
    eager = decode.config(decode.parse_args(["--eager", "--no-sinks"]))
    assert eager["graph_runs"] is None and "eager" in eager["timer"] and eager["sinks"] is None


def test_main_writes_a_record_the_report_renders(monkeypatch, tmp_path, capsys):
    """main() end to end with the device, the kernels and the timers replaced: rows by head dim, the
    skipped shape, the sinks table, and the record rendered by bench report."""
    from attnforge.benchmarks import report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (100 << 30, 141 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    monkeypatch.setattr(decode, "copy_bandwidth_gbps", lambda: 4000.0)
    monkeypatch.setattr(decode, "verify", lambda problem, layout: dict(max_abs=1e-3, rel_l2=1e-3))
    monkeypatch.setattr(decode, "make_problem", lambda *args, **kwargs: cpu_problem())
    monkeypatch.setattr(decode, "attnforge_decode",
                        lambda problem, layout, tensor_cores=False: ((lambda **extra: None), None))
    monkeypatch.setattr(decode, "timed_us", lambda run, args, flush, notes, what: 25.0)
    copies = []
    monkeypatch.setattr(decode, "same_bytes_copy_us", lambda nbytes, args, flush: copies.append(nbytes) or 20.0)
    out = tmp_path / "bench-decode.json"
    argv = ["--head-dims", "128", "512", "--batch", "1", "256", "--kv-len", "16384", "--no-peers", "--no-plan",
            "--no-pdl", "--no-overhead", "--no-flashinfer", "--out", str(out)]
    assert decode.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| bf16 | 512 | 256 | 16384 | n/a |" in printed and "| tensor cores | 25.0 | 25.0 | 1.000 |" in printed
    record = json.loads(out.read_text())
    rows = record["tables"]["decode"]
    assert [(r["head_dim"], r["batch"], r["us"] is None) for r in rows] == [
        (128, 1, False), (128, 256, False), (512, 1, False), (512, 256, True)]
    assert [c["head_dim"] for c in record["tables"]["check"]] == [128, 512]
    assert [r["copy_us"] for r in rows] == [20.0, 20.0, 20.0, None] and copies == [cpu_problem().bytes_moved] * 3
    assert len(record["tables"]["sinks"]) == 2
    assert report.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "| bf16 | 512 | 256 | 16384 | n/a |" in text and "| CUDA cores | 25.0 | 25.0 | 1.000 |" in text
    assert "| copy of the same bytes (µs) |" in text and "| bf16 | 128 | 1 | 16384 | 25.0 |" in text


@pytest.mark.parametrize("flag", ["--graph-runs", "--pdl-runs"])
def test_a_graph_of_no_runs_is_refused_with_the_option_named(flag, capsys):
    assert decode.main([flag, "0"]) == 2
    assert "--pdl-runs and --graph-runs must be at least 1" in capsys.readouterr().err


def test_an_unlisted_head_dim_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(["--head-dims", "384"])
    err = capsys.readouterr().err
    assert "--head-dims" in err and "invalid choice: 384" in err and "512" in err
