"""torch.compile support without a GPU (runtime/compile_ops.py): the custom ops are registered with
the schemas they document, their fake implementations give the kernels' output shapes and dtypes,
the handle registry does not keep wrappers alive, opcheck passes where the real implementation
runs on the CPU (the merges), and Dynamo traces each public entry point into its op with no graph
break (strict torch.export over planned-looking stand-in wrappers; the GPU test runs them)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnforge
from attnforge import compile_ops
from attnforge.decode import BatchDecodeWithPagedKVCacheWrapper
from attnforge.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

BF16, F32 = torch.bfloat16, torch.float32
HQ, HKV, PAGES, PAGE = 8, 2, 10, 16
NO_SCALES = ([None, None, None], None, None, None)  # scale_tensors, then the q/k/v float scales
NO_EXTRAS = (None, None, None)  # enable_pdl, window_left, sinks

OPS = {
    "batch_decode_run", "batch_decode_run_out", "batch_prefill_paged_run", "batch_prefill_paged_run_out",
    "batch_prefill_ragged_run", "batch_prefill_ragged_run_out", "single_decode", "single_prefill", "merge_state",
    "merge_states", "merge_state_in_place",
}


def _op(name: str):
    return getattr(torch.ops.attnforge, name).default


def _written(name: str) -> list[str]:
    return [a.name for a in _op(name)._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def test_ops_are_registered_under_their_names():
    assert OPS <= set(dir(torch.ops.attnforge))


@pytest.mark.parametrize("name, written", [
    *((f"batch_{family}_run", []) for family in ("decode", "prefill_paged", "prefill_ragged")),
    *((f"batch_{family}_run_out", ["out", "lse"]) for family in ("decode", "prefill_paged", "prefill_ragged")),
    ("single_decode", []), ("single_prefill", []), ("merge_state", []), ("merge_states", []),
    ("merge_state_in_place", ["v", "s"]),
])
def test_only_out_and_in_place_ops_write_their_arguments(name, written):
    assert _written(name) == written


# ------------------------------------------------------------------------------ fake implementations
def _shapes(outputs) -> list[tuple]:
    return [(tuple(t.shape), t.dtype) for t in outputs]


@pytest.mark.parametrize("return_lse, lse_shape", [(True, (3, HQ)), (False, (0,))])
@pytest.mark.parametrize("single_tensor", [False, True])
def test_fake_batch_decode(return_lse, lse_shape, single_tensor):
    with FakeTensorMode():
        q = torch.empty(3, HQ, 128, dtype=BF16)
        if single_tensor:
            k, v = torch.empty(PAGES, 2, PAGE, HKV, 128, dtype=BF16), None
        else:
            k = v = torch.empty(PAGES, PAGE, HKV, 128, dtype=BF16)
        outputs = _op("batch_decode_run")(1, q, k, v, [], *NO_SCALES, *NO_EXTRAS, return_lse, BF16)
    assert _shapes(outputs) == [((3, HQ, 128), BF16), (lse_shape, F32)]


@pytest.mark.parametrize("layout_shape", [(PAGES, PAGE, HKV), (PAGES, HKV, PAGE)], ids=["NHD", "HND"])
def test_fake_paged_prefill_with_head_dim_vo_below_qk(layout_shape):
    with FakeTensorMode():
        q = torch.empty(21, HQ, 192, dtype=BF16)
        k = torch.empty(*layout_shape, 192, dtype=BF16)
        v = k[..., :128]
        outputs = _op("batch_prefill_paged_run")(1, q, k, v, [], *NO_SCALES, *NO_EXTRAS, True, BF16)
    assert _shapes(outputs) == [((21, HQ, 128), BF16), ((21, HQ), F32)]


def test_fake_ragged_prefill_takes_the_planned_output_dtype():
    with FakeTensorMode():
        q = torch.empty(21, HQ, 128, dtype=torch.float8_e4m3fn)
        k = torch.empty(40, HKV, 128, dtype=torch.float8_e4m3fn)
        v = torch.empty(40, HKV, 64, dtype=torch.float8_e4m3fn)
        scales = [torch.ones(HQ), None, None], None, 0.5, 2.0
        outputs = _op("batch_prefill_ragged_run")(1, q, k, v, [], *scales, *NO_EXTRAS, True, BF16)
    assert _shapes(outputs) == [((21, HQ, 64), BF16), ((21, HQ), F32)]


@pytest.mark.parametrize("family", ["decode", "prefill_paged", "prefill_ragged"])
def test_fake_out_variants_return_nothing(family):
    with FakeTensorMode():
        q = torch.empty(21, HQ, 128, dtype=BF16)
        k = torch.empty(40, HKV, 128, dtype=BF16) if family == "prefill_ragged" else _paged()
        out, lse = torch.empty(21, HQ, 128, dtype=BF16), torch.empty(21, HQ)
        assert _op(f"batch_{family}_run_out")(1, q, k, k, [], *NO_SCALES, *NO_EXTRAS, out, lse) is None


@pytest.mark.parametrize("return_lse, lse_shape", [(True, (HQ,)), (False, (0,))])
def test_fake_single_decode(return_lse, lse_shape):
    with FakeTensorMode():
        q = torch.empty(HQ, 128, dtype=BF16)
        k = torch.empty(300, HKV, 128, dtype=BF16)
        outputs = _op("single_decode")(q, k, k, "NHD", "NONE", False, *NO_SCALES, -1, None, None, None, None,
                                       return_lse, BF16)
    assert _shapes(outputs) == [((HQ, 128), BF16), (lse_shape, F32)]


def test_fake_single_prefill():
    with FakeTensorMode():
        q = torch.empty(17, HQ, 192, dtype=torch.float16)
        k = torch.empty(HKV, 50, 192, dtype=torch.float16)  # HND
        v = torch.empty(HKV, 50, 128, dtype=torch.float16)
        outputs = _op("single_prefill")(q, k, v, *NO_SCALES, torch.float16, None, None, True, "HND", "NONE", False,
                                        None, -1, None, None, None, "auto", True, None, None, None)
    assert _shapes(outputs) == [((17, HQ, 128), torch.float16), ((17, HQ), F32)]


def test_fake_merges():
    with FakeTensorMode():
        v, s = torch.empty(5, HQ, 64, dtype=BF16), torch.empty(5, HQ)
        assert _shapes(_op("merge_state")(v, s, v, s)) == [((5, HQ, 64), BF16), ((5, HQ), F32)]
        vs, ss = torch.empty(5, 3, HQ, 64, dtype=torch.float16), torch.empty(5, 3, HQ, dtype=BF16)
        assert _shapes(_op("merge_states")(vs, ss)) == [((5, HQ, 64), torch.float16), ((5, HQ), F32)]
        assert _op("merge_state_in_place")(v, s, v, s, None) is None


def test_fake_merge_checks_arguments_while_tracing():
    with FakeTensorMode(), pytest.raises(ValueError, match="s_b must have shape"):
        _op("merge_state")(torch.empty(5, HQ, 64), torch.empty(5, HQ), torch.empty(5, HQ, 64), torch.empty(5, 1))


def test_out_dtype_defaults_as_plan_does():
    assert compile_ops.out_dtype(torch.float16, None) == torch.float16
    assert compile_ops.out_dtype(torch.float8_e4m3fn, None) == BF16
    assert compile_ops.out_dtype(BF16, "float16") == torch.float16


# ----------------------------------------------------------------------------------- the registry
def test_registry_holds_live_wrappers_only():
    class Wrapper:
        pass

    wrapper = Wrapper()
    handle = compile_ops.register(wrapper)
    assert compile_ops.register(Wrapper()) != handle
    assert compile_ops.wrapper_of(handle) is wrapper
    del wrapper
    gc.collect()
    assert handle not in compile_ops._live
    with pytest.raises(RuntimeError, match=f"handle {handle} is gone"):
        compile_ops.wrapper_of(handle)


# ----------------------------------------------------------------------------------------- opcheck
def _state(seed: int, *shape):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, HQ, 32, generator=gen), torch.randn(*shape, HQ, generator=gen) * 3


@pytest.mark.parametrize("name, make_args", [
    ("merge_state", lambda: (*_state(0, 6), *_state(1, 6))),
    ("merge_states", lambda: _state(2, 6, 3)),
    ("merge_state_in_place", lambda: (*_state(3, 6), *_state(4, 6), None)),
    ("merge_state_in_place", lambda: (*_state(5, 6), *_state(6, 6), torch.arange(6) % 2 == 0)),
])
def test_opcheck_merges(name, make_args):
    torch.library.opcheck(_op(name), make_args())


# ------------------------------------------------------------------- tracing the public functions
def _stand_in(cls, dtype_o=BF16, **attrs):
    """A wrapper as run() sees it after plan(), without a GPU: traced only, never run."""
    wrapper = object.__new__(cls)
    wrapper._handle = compile_ops.register(wrapper)
    wrapper._plan = SimpleNamespace(dtype_o=dtype_o)
    wrapper._tensor_cores = None
    for name, value in attrs.items():
        setattr(wrapper, name, value)
    return wrapper


def _traced_ops(fn, *args) -> list[str]:
    """The attnforge ops in the graph strict torch.export (Dynamo, no graph breaks) makes of fn."""

    class Fn(torch.nn.Module):
        def forward(self, *inputs):
            return fn(*inputs)

    graph = torch.export.export(Fn(), args, strict=True).graph
    return [str(node.target) for node in graph.nodes if str(node.target).startswith("attnforge.")]


def _paged(head_dim=128):
    return torch.randn(PAGES, PAGE, HKV, head_dim, dtype=BF16)


def test_decode_run_traces_into_its_op():
    w = _stand_in(BatchDecodeWithPagedKVCacheWrapper)
    q, k, v = torch.randn(3, HQ, 128, dtype=BF16), _paged(), _paged()
    assert _traced_ops(lambda q, k, v: w.run(q, (k, v), return_lse=True), q, k, v) == \
        ["attnforge.batch_decode_run.default"]


def test_tensor_core_decode_traces_into_the_decode_op_with_the_prefill_plans_dtype():
    inner = _stand_in(BatchPrefillWithPagedKVCacheWrapper, dtype_o=torch.float16)
    w = _stand_in(BatchDecodeWithPagedKVCacheWrapper, dtype_o=None, _tensor_cores=inner)
    w._plan = None
    q = torch.randn(3, HQ, 128, dtype=BF16)

    class Fn(torch.nn.Module):
        def forward(self, q, kv):
            return w.run(q, kv)

    ep = torch.export.export(Fn(), (q, torch.randn(PAGES, 2, PAGE, HKV, 128, dtype=BF16)), strict=True)
    (output,) = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    assert output.meta["val"].dtype == torch.float16


def test_run_with_out_traces_into_the_out_op():
    w = _stand_in(BatchPrefillWithPagedKVCacheWrapper)
    q, k, v = torch.randn(21, HQ, 128, dtype=BF16), _paged(), _paged()
    out = torch.empty(21, HQ, 128, dtype=BF16)
    ops = _traced_ops(lambda q, k, v, out: w.run(q, (k, v), out=out, return_lse=True), q, k, v, out)
    assert ops == ["attnforge.batch_prefill_paged_run_out.default"]


def test_ragged_run_traces_into_its_op():
    w = _stand_in(BatchPrefillWithRaggedKVCacheWrapper)
    q, k, v = torch.randn(21, HQ, 192, dtype=BF16), torch.randn(40, HKV, 192, dtype=BF16), torch.randn(40, HKV, 128,
                                                                                                       dtype=BF16)
    assert _traced_ops(lambda q, k, v: w.run_return_lse(q, k, v), q, k, v) == ["attnforge.batch_prefill_ragged_run.default"]


def test_single_functions_and_merges_trace_into_their_ops():
    q1, q, k = torch.randn(HQ, 128, dtype=BF16), torch.randn(5, HQ, 128, dtype=BF16), torch.randn(30, HKV, 128,
                                                                                                  dtype=BF16)

    def fn(q1, q, k):
        o1, s1 = attnforge.single_decode_with_kv_cache(q1, k, k, return_lse=True)
        o2, s2 = attnforge.single_prefill_with_kv_cache_return_lse(q, k, k, causal=True)
        o, s = attnforge.merge_state(o2, s2, o2, s2)
        attnforge.merge_state_in_place(o, s, o2, s2)
        return o1, s1, attnforge.merge_states(o[:, None], s[:, None])

    assert _traced_ops(fn, q1, q, k) == [f"attnforge.{name}.default" for name in (
        "single_decode", "single_prefill", "merge_state", "merge_state_in_place", "merge_states")]


def test_non_tensor_positional_arguments_are_refused_while_tracing():
    w = _stand_in(BatchDecodeWithPagedKVCacheWrapper)
    q, k = torch.randn(3, HQ, 128, dtype=BF16), _paged()
    with pytest.raises(Exception, match="extra positional arguments must be tensors"):
        _traced_ops(lambda q, k: w.run(q, (k, k), 1.0, 1.0, 1.0), q, k)


def test_a_replan_reuses_the_graph_and_another_output_dtype_recompiles():
    """Dynamo guards the planned output dtype, not the plan object: a serving loop that plans every
    step keeps its compiled graph."""
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: [torch.zeros(3, HQ, 128)]  # traced only: the kernels need a GPU

    torch._dynamo.reset()
    w = _stand_in(BatchDecodeWithPagedKVCacheWrapper)
    step = torch.compile(lambda q, k: w.run(q, (k, k)), fullgraph=True, backend=count_graphs)
    q, k = torch.randn(3, HQ, 128, dtype=BF16), _paged()
    for dtype_o, expected_graphs in ((BF16, 1), (BF16, 1), (torch.float16, 2)):
        w._plan = SimpleNamespace(dtype_o=dtype_o)
        step(q, k)
        assert len(graphs) == expected_graphs
    torch._dynamo.reset()
