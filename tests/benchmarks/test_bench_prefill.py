"""bench prefill without a GPU: head dims and the rules' refusals, SDPA refusals as notes, and the sinks
table's timing and arithmetic, with a fake library and timer in place of the device (CPU)."""

from __future__ import annotations

import functools
import math
import types
import warnings

import pytest
import torch

from attnforge import reference
from attnforge.benchmarks import _shapes, prefill
from attnforge.codegen.rules import HEAD_DIMS
from attnforge.codegen.spec import Arch

ISSUE_38_DIMS = ["64", "80", "96", "112", "128", "160", "192", "224", "256", "512"]


@pytest.fixture
def on_sm90(monkeypatch):
    """fa2 and fa3 both in BACKENDS, problems on the CPU, a timer that needs no device."""
    monkeypatch.setattr(prefill, "BACKENDS", ("fa2", "fa3"))
    monkeypatch.setattr(prefill, "make_problem", functools.partial(prefill.make_problem, device="cpu"))
    monkeypatch.setattr(prefill, "time_cuda_us", lambda run, iters, warmup: (run(), 10.0)[1])
    monkeypatch.setattr(prefill, "WORKSPACE_BYTES", 1024)


class Library:
    """A stand-in for attnforge: its wrappers record every run() (the wrapper, its keywords) and write
    the reference output into out, plus 1 where sinks are given (so they show as applied)."""

    def __init__(self):
        self.runs = []
        for name in ("BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper"):
            setattr(self, name, self._wrapper())

    def _wrapper(self):
        library = self

        class Wrapper:
            def __init__(self, workspace, layout, backend):
                self.backend = backend

            def plan(self, qo_indptr, *args, causal, **kwargs):
                self.causal = causal

            def run(self, q, *args, out, **kwargs):
                library.runs.append((self, kwargs))
                out.fill_(1.0 if kwargs.get("sinks") is not None else 0.0)
                return out

        return Wrapper


def test_every_issue_38_head_dim_parses_and_has_its_heads(capsys):
    args = prefill.parse_args(["--shapes", "4x4096", "--head-dims", *ISSUE_38_DIMS])
    assert args.head_dims == [int(d) for d in ISSUE_38_DIMS] and args.shapes == [(4, 4096)] and not args.no_sinks
    assert prefill.HEADS_BY_HEAD_DIM[128] == (32, 8) and prefill.HEADS_BY_HEAD_DIM[160] == (16, 4)
    assert prefill.HEADS_BY_HEAD_DIM[512] == (16, 4)
    assert prefill.parse_args(["--no-sinks"]).no_sinks
    with pytest.raises(SystemExit):
        prefill.parse_args(["--head-dims", "384"])
    err = capsys.readouterr().err
    assert "--head-dims" in err and "invalid choice: 384" in err


def test_more_head_dims_default_to_4x4096_and_follow_the_head_dims():
    args = prefill.parse_args(["--head-dims", "64", "128", "--more-head-dims", "80", "64", "512"])
    assert args.more_shapes == [(4, 4096)]
    pairs = _shapes.head_dim_shapes(args.head_dims, args.shapes, args.more_head_dims, args.more_shapes)
    assert pairs == [(d, s) for d in (64, 128) for s in args.shapes] + [(80, (4, 4096)), (512, (4, 4096))]
    assert prefill.config(prefill.parse_args(["--more-shapes", "2x8192"]))["more_shapes"] == ["2 x 8192"]
    for bad in (["--more-shapes", "4x"], ["--more-head-dims", "384"]):
        with pytest.raises(SystemExit):
            prefill.parse_args(bad)


def test_the_rules_refuse_fa3_at_512_only_and_fa2_at_512_on_small_smem_archs():
    assert all(prefill.refusal("fa2", d) is None for d in prefill.BENCH_HEAD_DIMS)
    assert all(prefill.refusal("fa3", d) is None for d in HEAD_DIMS)
    assert prefill.refusal("fa3", 512).startswith("[fa3-head-dim-512] fa3 has no kernel for head dim 512")
    assert prefill.refusal("fa2", 512, (Arch.SM86,)).startswith("[fa2-head-dim-512-smem]")


def test_a_refused_backend_is_left_out_with_the_rule_in_the_notes(on_sm90):
    notes = []
    assert prefill.backends_at(256, notes) == ("fa2", "fa3") and notes == []
    assert prefill.backends_at(512, notes) == ("fa2",)
    assert notes == ["fa3 n/a: " + prefill.refusal("fa3", 512)]


def fake_sdpa(problem, batch, causal, backend):
    """SDPA on the CPU: cuDNN refuses as torch does (warnings saying why, then a RuntimeError), FLASH
    returns zeros."""
    from torch.nn.attention import SDPBackend

    if backend == SDPBackend.CUDNN_ATTENTION:
        warnings.warn("cuDNN attention kernel not used because:")
        warnings.warn("head_dim should be no more than 256, got 512\nmore detail")
        raise RuntimeError("No available kernel. Aborting execution.")
    return (lambda: None), torch.zeros(problem.q.shape, dtype=problem.q.dtype)


def test_measure_at_512_runs_fa2_alone_and_says_why_fa3_and_cudnn_are_n_a(on_sm90, monkeypatch):
    library = Library()
    monkeypatch.setattr(prefill, "ours", lambda *a: prefill.prefill_call(library, *a))
    monkeypatch.setattr(prefill, "sdpa", fake_sdpa)
    args = types.SimpleNamespace(iters=1, warmup=0, no_peers=False)
    row = prefill.measure(2, 32, prefill.Heads.for_head_dim(512), True, args)
    assert {(w.backend, kwargs.get("sinks")) for w, kwargs in library.runs} == {("fa2", None)}
    assert row.head_dim == 512 and row.paged_us == row.ragged_us == 10.0
    assert row.paged_tflops == pytest.approx(prefill.flop_count(2, 32, prefill.Heads(16, 4, 512), True) / 10e6)
    assert row.fa3_paged_tflops is row.fa3_ragged_tflops is row.fa3_paged_us is None
    assert row.cudnn_tflops is None and row.flash_tflops is not None
    assert row.notes == ("fa3 n/a: " + prefill.refusal("fa3", 512) + "; cudnn n/a: No available kernel. Aborting "
                         "execution. / head_dim should be no more than 256, got 512")


def test_measure_at_a_new_head_dim_runs_both_backends(on_sm90, monkeypatch):
    library = Library()
    monkeypatch.setattr(prefill, "ours", lambda *a: prefill.prefill_call(library, *a))
    row = prefill.measure(2, 32, prefill.Heads.for_head_dim(80), False,
                          types.SimpleNamespace(iters=1, warmup=0, no_peers=True))
    assert sorted({w.backend for w, _ in library.runs}) == ["fa2", "fa3"]
    assert row.fa3_paged_tflops == row.paged_tflops and row.notes == ""


def test_sdpa_refusal_keeps_each_reason_once_without_torch_s_headers():
    exc = RuntimeError("No available kernel.\nsecond line")
    note = prefill.sdpa_refusal("cudnn", exc, ["Flash attention kernel not used because:", "head dim 512", "head dim 512"])
    assert note == "cudnn n/a: No available kernel. / head dim 512"
    assert len(prefill.sdpa_refusal("flash", exc, ["x" * 400])) == len("flash n/a: ") + 300


def test_sdpa_refusal_keeps_torch_s_reason_at_hd_512_and_drops_what_it_says_of_the_disabled_backends():
    """The warnings torch 2.11 gives for SDPA pinned to cuDNN at head dim 512 (2026-12-04 run)."""
    where = " (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:986.)"
    warned = ["Memory efficient kernel not used because:" + where,
              "Memory Efficient attention has been runtime disabled." + where,
              "Flash attention kernel not used because:" + where,
              "head_dim should be no more than 256" + where,
              "cuDNN attention has been runtime disabled." + where]
    note = prefill.sdpa_refusal("cudnn", RuntimeError("No available kernel. Aborting execution."), warned)
    assert note == "cudnn n/a: No available kernel. Aborting execution. / head_dim should be no more than 256"


def test_verify_checks_every_head_dim_on_the_backends_the_rules_accept(on_sm90, monkeypatch):
    monkeypatch.setattr(prefill, "VERIFY_BATCH", 2)
    monkeypatch.setattr(prefill, "VERIFY_LENGTH", 20)

    def exact(problem, causal, paged, backend):
        out = torch.empty_like(problem.q)
        o_ref, _ = reference.batch_prefill_ragged(problem.q, problem.k, problem.v, problem.qo_indptr,
                                                  problem.qo_indptr, causal=causal)
        return (lambda **extra: out.copy_(o_ref)), out

    monkeypatch.setattr(prefill, "ours", exact)
    checks = prefill.verify([96, 512])
    assert {(c["head_dim"], c["backend"]) for c in checks} == {(96, "fa2"), (96, "fa3"), (512, "fa2")}
    assert len(checks) == 3 * 4 and all(c["max_abs"] < 1e-2 for c in checks)
    monkeypatch.setattr(prefill, "ours", lambda problem, *a: ((lambda: None), torch.zeros_like(problem.q)))
    with pytest.raises(AssertionError, match="fa2 prefill hd 96"):  # out stays NaN-filled
        prefill.verify([96])


def test_prefill_call_passes_run_s_keywords_to_the_same_wrapper(on_sm90):
    library = Library()
    problem = prefill.make_problem(2, 16, prefill.Heads(4, 2, 64))
    sinks = torch.zeros(4)
    for paged in (True, False):
        run, out = prefill.prefill_call(library, problem, False, paged, "fa2")
        run()
        run(sinks=sinks)
        (first, plain), (second, with_sinks) = library.runs[-2:]
        assert first is second and "sinks" not in plain and with_sinks["sinks"] is sinks and out.eq(1).all()


def test_fastest_alternately_takes_turns_and_keeps_each_one_s_least():
    order, times = [], iter([5.0, 9.0, 4.0, 8.0, 6.0, 10.0])

    def timer(run):
        order.append(run)
        return next(times)

    assert prefill.fastest_alternately({"a": "A", "b": "B"}, timer, rounds=3) == {"a": 4.0, "b": 8.0}
    assert order == ["A", "B"] * 3


def test_sinks_row_ratio_is_time_without_over_time_with():
    row = prefill.sinks_row("fa3", True, 97.0, 100.0, 0.25)
    assert row["no_sinks_over_sinks"] == pytest.approx(0.97) and row["notes"] == ""
    assert row["no_sinks_over_sinks"] >= prefill.SINKS_TARGET - 1e-12
    assert (row["batch"], row["length"], row["head_dim"], row["paged"]) == (4, 4096, 128, True)
    assert prefill.sinks_row("fa2", False, 100.0, 104.0, 0.1)["no_sinks_over_sinks"] < prefill.SINKS_TARGET
    assert prefill.sinks_row("fa2", False, 1.0, 1.0, 0.0)["notes"] == "sinks changed no output: not applied?"
    assert prefill.sinks_row("fa2", False, 1.0, 1.0, math.nan)["notes"] == "the output with sinks is not finite"


def test_sinks_rows_time_both_calls_on_one_wrapper_per_backend_and_causal_flag(on_sm90, monkeypatch):
    library = Library()
    monkeypatch.setattr(prefill, "ours", lambda *a: prefill.prefill_call(library, *a))
    monkeypatch.setattr(prefill, "SINKS_BATCH", 2)
    monkeypatch.setattr(prefill, "SINKS_LENGTH", 32)
    rows = prefill.sinks_rows(types.SimpleNamespace(iters=1, warmup=0))
    assert [(r["backend"], r["causal"]) for r in rows] == [("fa2", False), ("fa2", True), ("fa3", False),
                                                           ("fa3", True)]
    assert all(r["no_sinks_over_sinks"] == 1.0 and r["max_abs_vs_no_sinks"] == 1.0 and r["notes"] == "" for r in rows)
    wrappers = {}
    for wrapper, kwargs in library.runs:
        wrappers.setdefault(wrapper, []).append(kwargs.get("sinks"))
    assert len(wrappers) == 4
    for wrapper, sinks in wrappers.items():
        assert wrapper.backend in ("fa2", "fa3")
        given = [s for s in sinks if s is not None]
        # once each to compare outputs, then SINKS_ROUNDS timed calls each, in turn
        assert len(given) == len(sinks) - len(given) == 1 + prefill.SINKS_ROUNDS
        assert sinks[2:] == [None, given[0]] * prefill.SINKS_ROUNDS
        assert given[0].dtype == torch.float32 and given[0].shape == (prefill.ACCEPTANCE.qo,)


def test_config_names_the_sinks_method_or_none():
    assert prefill.config(prefill.parse_args(["--no-sinks"]))["sinks"] is None
    c = prefill.config(prefill.parse_args([]))
    assert c["sinks"]["target"] == prefill.SINKS_TARGET and c["sinks"]["rounds"] == prefill.SINKS_ROUNDS
    assert c["heads_by_head_dim"]["512"] == dict(num_qo_heads=16, num_kv_heads=4)
