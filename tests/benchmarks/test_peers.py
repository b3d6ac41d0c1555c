"""FlashInfer as a same-run peer, without a GPU: a fake library that records its wrappers' calls gets
exactly the calls attnforge gets; a peer that raises is n/a plus a note; --no-flashinfer skips it (CPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attnforge.benchmarks import _peers, decode, fp8, prefill


class Recorder:
    """A stand-in library: every wrapper records (class, constructor, plan and run arguments); run()
    returns `out` (or raises `fail`)."""

    def __init__(self, fail: Exception | None = None):
        self.calls, self.fail = [], fail
        for name in ("BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
                     "BatchDecodeWithPagedKVCacheWrapper"):
            setattr(self, name, self._wrapper(name))

    def _wrapper(self, name):
        library = self

        class Wrapper:
            def __init__(self, workspace, *args, **kwargs):
                library.calls.append((name, "init", args, kwargs))

            def plan(self, *args, **kwargs):
                library.calls.append((name, "plan", args, kwargs))

            def run(self, *args, **kwargs):
                library.calls.append((name, "run", args, kwargs))
                if library.fail is not None:
                    raise library.fail
                return kwargs["out"].zero_()

        return Wrapper


def same(a, b, key=None) -> bool:
    """Equal call records; tensors by identity (the very same tensors reach both libraries), but for
    out, each library's own, of the same shape and dtype."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if key == "out":
            return a is not b and a.shape == b.shape and a.dtype == b.dtype
        return a is b
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], k) for k in a)
    return a == b


def cpu_prefill_problem(dtype=torch.bfloat16, kv_dtype=None) -> prefill.Problem:
    h = prefill.Heads(4, 2, 64)
    q, k, v = (torch.zeros(2 * 16, heads, h.dim, dtype=dtype) for heads in (h.qo, h.kv, h.kv))
    if kv_dtype is not None:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    cache = tuple(torch.zeros(2, prefill.PAGE_SIZE, h.kv, h.dim, dtype=k.dtype) for _ in "kv")
    return prefill.Problem(h, q, k, v, torch.tensor([0, 16, 32], dtype=torch.int32), cache,
                           torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32),
                           torch.tensor([16, 16], dtype=torch.int32))


def run_both(build):
    """The records of build(library) planned and run once, for two fake libraries."""
    ours, theirs = Recorder(), Recorder()
    for library in (ours, theirs):
        run, _ = build(library)
        run()
    return ours.calls, theirs.calls


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_prefill_reaches_both_libraries_with_the_same_arguments(paged, backend, monkeypatch):
    monkeypatch.setattr(prefill, "WORKSPACE_BYTES", 1024)
    problem = cpu_prefill_problem()
    ours, theirs = run_both(lambda lib: prefill.prefill_call(lib, problem, True, paged, backend))
    assert same(ours, theirs) and [c[:2] for c in ours] == [(ours[0][0], "init"), (ours[0][0], "plan"),
                                                           (ours[0][0], "run")]
    assert ours[0][0] == f"BatchPrefillWith{'Paged' if paged else 'Ragged'}KVCacheWrapper"
    assert ours[0][2:] == (("NHD",), {"backend": backend})
    plan_kwargs = ours[1][3]
    assert plan_kwargs["causal"] is True and plan_kwargs["q_data_type"] == torch.bfloat16
    assert plan_kwargs["o_data_type"] == torch.bfloat16
    run_args = ours[2][2]
    assert run_args[0] is problem.q and (run_args[1] is problem.cache if paged else run_args[1:] == (problem.k, problem.v))


def test_fp8_query_scales_go_positionally_and_fp8_kv_scales_as_keywords(monkeypatch):
    """FlashInfer 0.7.4's ragged run reads an fp8 query's scales only from the positional arguments."""
    monkeypatch.setattr(prefill, "WORKSPACE_BYTES", 1024)
    full = cpu_prefill_problem(fp8.E4M3, fp8.E4M3)
    ours, theirs = run_both(lambda lib: prefill.prefill_call(lib, full, False, False, "fa3", fp8.SCALES.kwargs))
    assert same(ours, theirs)
    assert ours[2][2][3:] == (fp8.SCALES.q, fp8.SCALES.k, fp8.SCALES.v) and "q_scale" not in ours[2][3]
    kv_only = cpu_prefill_problem(kv_dtype=fp8.E4M3)
    ours, theirs = run_both(lambda lib: prefill.prefill_call(lib, kv_only, False, True, "fa2", fp8.KV_SCALES))
    assert same(ours, theirs)
    assert len(ours[2][2]) == 2 and ours[2][3]["k_scale"] == fp8.SCALES.k and ours[2][3]["v_scale"] == fp8.SCALES.v


@pytest.mark.parametrize("tensor_cores, backend", [(False, "auto"), (True, "fa2"), (True, "fa3")])
def test_decode_reaches_both_libraries_with_the_same_arguments(tensor_cores, backend):
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    cache = tuple(torch.zeros(3, decode.PAGE_SIZE, 2, 64, dtype=torch.float8_e4m3fn) for _ in "kv")
    problem = decode.Problem(q, cache, torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([2, 0]),
                             torch.tensor([5, 16], dtype=torch.int32), None, None)
    workspace = torch.empty(16, dtype=torch.uint8)
    ours, theirs = run_both(lambda lib: decode.decode_call(lib, problem, "NHD", workspace, tensor_cores, backend))
    assert same(ours, theirs)
    assert ours[0][2:] == (("NHD",), {"use_tensor_cores": tensor_cores, "backend": backend})
    assert ours[1][2][3:] == (8, 2, 64, decode.PAGE_SIZE)  # qo heads, kv heads, head dim, page size
    assert ours[1][3]["kv_data_type"] == torch.float8_e4m3fn and ours[2][2] == (q, cache)


def test_a_raising_peer_is_n_a_with_the_reason_in_the_notes_and_not_tried_again(monkeypatch, capsys):
    monkeypatch.setattr(prefill, "WORKSPACE_BYTES", 1024)
    problem = cpu_prefill_problem()
    library = Recorder(fail=RuntimeError("Ninja build failed\nlong compiler output"))
    peer = _peers.Peer(library)
    builds = prefill.builds(problem, False, [("fa3", True)])
    peer.warm(builds)
    assert "FlashInfer: first call of fa3 paged prefill hd 64" in capsys.readouterr().err
    key = prefill.call_key("fa3", True, problem)
    assert peer.failed == {key: "RuntimeError: Ninja build failed"}
    notes = []
    tried = len(library.calls)
    assert peer.timed(key, builds[key], lambda run: 1.0, notes) is None
    assert notes == [f"FlashInfer {key} n/a: RuntimeError: Ninja build failed"]
    assert len(library.calls) == tried  # a failed module is not built again


def test_a_peer_that_runs_is_timed_and_checked(monkeypatch):
    monkeypatch.setattr(prefill, "WORKSPACE_BYTES", 1024)
    problem = cpu_prefill_problem()
    peer = _peers.Peer(Recorder())
    builds = prefill.builds(problem, False, [("fa2", False)])
    ours_out = torch.ones(problem.q.shape, dtype=torch.bfloat16)  # the fake's out stays zero: a mismatch
    monkeypatch.setattr(prefill, "time_cuda_us", lambda run, iters, warmup: 7.0)  # CUDA events need a GPU
    notes = []
    times, err = prefill.peer_us(peer, builds, dict.fromkeys(builds, ours_out),
                                 types.SimpleNamespace(iters=1, warmup=0), notes)
    assert list(times.values()) == [7.0] and err == pytest.approx(1.0)
    assert notes == ["FlashInfer fa2 ragged prefill hd 64 output differs from ours by relative L2 1"]


def test_no_flashinfer_skips_the_import_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.7.4"))
    for module in (prefill, decode, fp8):
        args = module.parse_args(["--no-flashinfer"])
        peer = _peers.Peer.from_args(args)
        assert not peer.present and peer.config()["note"] == _peers.NO_FLASHINFER
        assert peer.timed("any", lambda lib: pytest.fail("built"), lambda run: 1.0, []) is None
        assert _peers.Peer.from_args(module.parse_args([])).version == "0.7.4"


def test_a_missing_flashinfer_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    peer = _peers.Peer.from_args(prefill.parse_args([]))
    assert not peer.present and peer.note.startswith("FlashInfer not importable (ModuleNotFoundError")
    assert peer.config()["version"] is None


def test_the_peer_runs_at_its_prebuilt_head_dims_only():
    assert [d for d in (64, 80, 128, 192, 256, 512) if not _peers.skip_note(d)] == [64, 128, 256]
    assert _peers.skip_note(80) == "FlashInfer not run at hd 80 (timed at hd 64, 128, 256 only)"
    assert _peers.Peer(None, "absent").config()["head_dims"] == [64, 128, 256]


def test_prebuild_builds_each_timed_module_in_one_call(monkeypatch):
    """prebuild() hands every module to one build_jit_specs call, each through the generator its
    wrappers load: CUDA-core decode, the fa2 prefill module (also its tensor-core decode), fa3."""
    made, builds = [], []
    jit = types.ModuleType("flashinfer.jit.attention.modules")
    generators = {"decode": "gen_batch_decode_module", "fa2": "_gen_batch_prefill_primary_module",
                  "fa3": "gen_batch_prefill_module"}
    for name in generators.values():
        setattr(jit, name, lambda *a, name=name: made.append((name, *a)) or len(made))
    core = types.ModuleType("flashinfer.jit.core")
    core.build_jit_specs = lambda specs, verbose: builds.append(list(specs))
    attention = types.ModuleType("flashinfer.jit.attention")
    attention.modules = jit
    for name, module in {"flashinfer": types.ModuleType("flashinfer"), "flashinfer.jit": types.ModuleType("flashinfer.jit"),
                         "flashinfer.jit.attention": attention, "flashinfer.jit.attention.modules": jit,
                         "flashinfer.jit.core": core}.items():
        monkeypatch.setitem(sys.modules, name, module)
    modules = _peers.timed_modules(fp8.DEFAULT_HEAD_DIMS)
    _peers.prebuild(modules)
    assert builds == [list(range(1, len(modules) + 1))]
    for m, call in zip(modules, made):
        dtypes = (getattr(torch, m.dtype_q), getattr(torch, m.dtype_kv), torch.bfloat16, torch.int32)
        backend = () if m.kind == "decode" else (m.kind,)
        fp16_qk_reduction = () if m.kind == "decode" else (False,)
        assert call == (generators[m.kind], *backend, *dtypes, m.head_dim, m.head_dim, 0, False, False,
                        *fp16_qk_reduction)


def test_timed_modules_cover_every_head_dim_and_path():
    modules = _peers.timed_modules(fp8.DEFAULT_HEAD_DIMS)
    assert len(set(modules)) == len(modules)
    for dim in _peers.HEAD_DIMS:
        for kind in ("decode", "fa2", "fa3"):
            assert _peers.PeerModule(kind, "bfloat16", "bfloat16", dim) in modules
    for dim in fp8.DEFAULT_HEAD_DIMS:
        assert _peers.PeerModule("fa3", "float8_e4m3fn", "float8_e4m3fn", dim) in modules
        assert _peers.PeerModule("fa2", "bfloat16", "float8_e4m3fn", dim) in modules
