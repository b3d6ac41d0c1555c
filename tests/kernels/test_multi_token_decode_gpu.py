"""Multi-token decode (speculative verification) on the GPU: the tensor-core decode wrapper planned
with q_len_per_req > 1 against attnforge.reference, fa2 and fa3, eager and under CUDA graphs.

Each request has q_len_per_req query rows, the last q_len_per_req of its KV tokens, causal among
them (bottom-right aligned: row i sees keys [0, kv_len - q_len + i]). Inputs are randn, outputs
poisoned with NaN. Modules: bf16 hd128 fa2 and fa3 prefill (the default manifest's), and the fa2
one over an e4m3 cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import attnforge
from attnforge import reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
WORKSPACE = 256 << 20
HEAD_DIM, PAGE = 128, 16
O_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 output vs the fp32 reference
LSE_TOL = dict(atol=1e-2, rtol=1e-3)
E4M3 = torch.float8_e4m3fn


@dataclass
class Case:
    backend: str
    kv_dtype: torch.dtype
    q_len: int
    kv_lens: list[int]
    num_kv_heads: int
    group: int
    seed: int

    @property
    def num_qo_heads(self) -> int:
        return self.num_kv_heads * self.group


@st.composite
def cases(draw, backends=("fa2", "fa3")):
    backend = draw(st.sampled_from(backends))
    kv_dtype = draw(st.sampled_from([torch.bfloat16, E4M3] if backend == "fa2" else [torch.bfloat16]))
    q_len = draw(st.integers(2, 4))
    batch = draw(st.integers(1, 24))
    kv_lens = draw(st.lists(st.integers(q_len, 3000), min_size=batch, max_size=batch))
    return Case(backend, kv_dtype, q_len, kv_lens, draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 4, 8])),
                draw(st.integers(0, 2**31 - 1)))


def gpu_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Batch:
    q: torch.Tensor  # [batch * q_len, Hq, D]
    cache: tuple[torch.Tensor, torch.Tensor]  # NHD pages
    indptr: torch.Tensor
    page_ids: torch.Tensor
    last: torch.Tensor


def make_batch(case: Case, pool: int | None = None, cache=None) -> Batch:
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    pages = [math.ceil(n / PAGE) for n in case.kv_lens]
    pool = pool or sum(pages) + 3
    if cache is None:
        cache = tuple(torch.randn(pool, PAGE, case.num_kv_heads, HEAD_DIM, device=DEVICE, generator=gen)
                      .to(case.kv_dtype) for _ in "kv")
    page_ids = torch.randperm(pool, device=DEVICE, generator=gen)[: sum(pages)].int()
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(case.kv_lens, pages)], dtype=torch.int32)
    q = torch.randn(len(case.kv_lens) * case.q_len, case.num_qo_heads, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE,
                    generator=gen)
    return Batch(q, cache, indptr, page_ids, last)


def plan(wrapper, case: Case, b: Batch) -> None:
    wrapper.plan(b.indptr, b.page_ids, b.last, case.num_qo_heads, case.num_kv_heads, HEAD_DIM, PAGE,
                 q_data_type=torch.bfloat16, kv_data_type=case.kv_dtype, q_len_per_req=case.q_len)


def wrapper_for(case: Case, **graph_buffers):
    return attnforge.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE), "NHD", use_tensor_cores=True, backend=case.backend,
        **graph_buffers)


def check(case: Case, b: Batch, out: torch.Tensor, lse: torch.Tensor) -> None:
    qo_indptr = torch.arange(len(case.kv_lens) + 1, dtype=torch.int32) * case.q_len
    cache = tuple(c.float() for c in b.cache) if case.kv_dtype == E4M3 else b.cache
    o_ref, lse_ref = reference.batch_prefill_paged(b.q, cache, qo_indptr, b.indptr, b.page_ids, b.last, causal=True,
                                                   o_dtype=torch.float32)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in the output: rows left unwritten"
    torch.testing.assert_close(out.float(), o_ref, **O_TOL)
    torch.testing.assert_close(lse, lse_ref, **LSE_TOL)


def run_poisoned(wrapper, b: Batch, out=None, lse=None):
    out = torch.full_like(b.q, math.nan) if out is None else out.fill_(math.nan)
    lse = torch.full(b.q.shape[:2], math.nan, device=DEVICE) if lse is None else lse.fill_(math.nan)
    wrapper.run(b.q, b.cache, out=out, lse=lse, return_lse=True)
    return out, lse


@gpu_settings(max_examples=24)
@given(cases())
def test_multi_token_decode_matches_reference(case):
    note(str(case))
    b = make_batch(case)
    wrapper = wrapper_for(case)
    plan(wrapper, case, b)
    check(case, b, *run_poisoned(wrapper, b))


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_last_row_of_each_request_equals_single_token_decode(backend):
    """The last verified token sees every key: its row equals one-token decode of that row alone."""
    case = Case(backend, torch.bfloat16, 3, [17, 300, 3, 1024, 45], num_kv_heads=2, group=4, seed=11)
    b = make_batch(case)
    multi = wrapper_for(case)
    plan(multi, case, b)
    out, lse = run_poisoned(multi, b)
    last_rows = torch.arange(case.q_len - 1, b.q.shape[0], case.q_len, device=DEVICE)
    single_case = Case(backend, torch.bfloat16, 1, case.kv_lens, 2, 4, 11)
    single = wrapper_for(single_case)
    plan(single, single_case, b)
    one = Batch(b.q[last_rows].contiguous(), b.cache, b.indptr, b.page_ids, b.last)
    out1, lse1 = run_poisoned(single, one)
    torch.testing.assert_close(out[last_rows].float(), out1.float(), **O_TOL)
    torch.testing.assert_close(lse[last_rows], lse1, **LSE_TOL)


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_cuda_graph_replays_multi_token_decode_after_replan(backend, debug, monkeypatch):
    """Capture run() once with q_len_per_req=3, re-plan with other lengths, replay: each replay equals
    the reference. A plan with another q_len_per_req is refused (the graph fixed it). With
    ATTNFORGE_DEBUG=1 (the prefill kernel's wrapper) the capture checks launches without synchronizing."""
    monkeypatch.setenv("ATTNFORGE_DEBUG", "1" if debug else "0")
    first = Case(backend, torch.bfloat16, 3, [40, 700, 3, 129], num_kv_heads=2, group=4, seed=5)
    second = Case(backend, torch.bfloat16, 3, [1500, 3, 64, 900], num_kv_heads=2, group=4, seed=6)
    pool = sum(math.ceil(n / PAGE) for c in (first, second) for n in c.kv_lens) + 3
    b1 = make_batch(first, pool)
    b2 = make_batch(second, pool, cache=b1.cache)
    batch = len(first.kv_lens)
    wrapper = wrapper_for(first, use_cuda_graph=True,
                          paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
                          paged_kv_indices_buffer=torch.empty(pool, dtype=torch.int32, device=DEVICE),
                          paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=DEVICE))
    q = b1.q.clone()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=DEVICE)
    plan(wrapper, first, b1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, b1.cache, out=out, lse=lse, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, b1.cache, out=out, lse=lse, return_lse=True)
    for case, b in ((first, b1), (second, b2)):
        if b is b2:
            plan(wrapper, case, b)
        q.copy_(b.q)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        check(case, Batch(q, b.cache, b.indptr, b.page_ids, b.last), out, lse)
    assert wrapper._qo_indptr_buf.tolist() == [0, 3, 6, 9, 12]
    with pytest.raises(ValueError, match="q_len_per_req: this CUDA-graph wrapper was planned with 3, got 2"):
        plan(wrapper, Case(backend, torch.bfloat16, 2, second.kv_lens, 2, 4, 7), b2)
