"""FA2 batch decode plans over their lifetime on the GPU: CUDA-graph replays after a re-plan, repeated
runs and replays of a split batch (the fused merge's counters), a wrapper dropped before its plan
image was uploaded, bad page ids and fixed splits (a request's bits alone and in a batch). Cases,
runs and checks: decode_cases.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import attnforge
from attnforge.codegen.abi import PLAN_HEADER

from decode_cases import (Batch, Case, DEVICE, LSE_TOL, MODULES, NAN, O_TOL, PLAIN_MODULES, alloc_cache, cases,
                          check_against_reference, decode, gpu_settings, kv_lengths, make_batch, page_table, plan,
                          reference_of, run_poisoned, token_budget, workspace_for)

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------------------------------
# CUDA graphs and bad input


@gpu_settings(max_examples=10)
@given(cases(modules=PLAIN_MODULES + [MODULES[4]], max_batch=64, max_tokens=300_000), st.data())
def test_cuda_graph_replays_after_replan(case, data):
    """Capture run() once, then re-plan with other lengths and page tables (same batch size)
    and replay: plan() may only change buffer contents, never what the graph captured."""
    batch = len(case.kv_lens)
    budget = token_budget(case.module, case.num_kv_heads, 300_000)
    lens2 = data.draw(kv_lengths(batch, budget), label="kv_lens of the second plan")
    case2 = replace(case, kv_lens=lens2, seed=case.seed + 1)
    note(case.describe() + f"\nsecond plan kv_lens={lens2}")
    num_pages = max(sum(c.pages_per_request) for c in (case, case2)) + case.spare_pages + 1
    gpu_gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    cache = alloc_cache(case, num_pages, gpu_gen)

    def batch_for(c: Case) -> Batch:
        tables = page_table(c.kv_lens, c.page_size, num_pages, torch.Generator().manual_seed(c.seed))
        q = torch.randn(batch, c.num_qo_heads, c.module.head_dim, dtype=c.module.dtype, device=DEVICE, generator=gpu_gen)
        return Batch(q, cache, tables[0], tables[1], tables[2], num_pages)

    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
        workspace_for(case), kv_layout=case.layout, use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indices_buffer=torch.empty(num_pages, dtype=torch.int32, device=DEVICE),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=DEVICE),
    )
    first = batch_for(case)
    q = first.q.clone()  # the graph's static input
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEVICE)
    plan(wrapper, case, first)
    side = torch.cuda.Stream()  # warm up off the default stream, as torch.cuda.graph expects
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True)

    for c, b in ((case, first), (case2, batch_for(case2))):
        if b is not first:
            plan(wrapper, c, b)
        q.copy_(b.q)
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(c, b, out, lse)


# A batch the planner splits (short requests beside long ones, an empty one): split requests merge
# inside the decode kernel, whose per-(request, kv head, head tile) counters must be back at 0 after
# every run for the next run or replay to merge again. Group 16 takes two head tiles per kv head.
SPLIT_LENS = [6000, 37, 2500, 0, 900]


def _split_case(group: int) -> Case:
    return Case(module=MODULES[1], layout="NHD", single_tensor=False, page_size=16, kv_lens=SPLIT_LENS,
                num_kv_heads=2, group=group, spare_pages=5, seed=11 + group)


def _num_partials(wrapper) -> int:
    return wrapper._image.read_slot(PLAN_HEADER.index("num_partials"))


@pytest.mark.parametrize("fixed_split_size", [None, 16], ids=["planner-split", "fixed-split-16"])
@pytest.mark.parametrize("group", [1, 5, 16])
def test_repeated_runs_after_one_plan_merge_every_time(group, fixed_split_size):
    case = _split_case(group)
    b = make_batch(case)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(workspace_for(case, 64 << 20), kv_layout=case.layout)
    plan(wrapper, case, b, fixed_split_size=fixed_split_size)
    assert _num_partials(wrapper) > 1, "the batch must be split for the fused merge to run"
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    for _ in range(3):
        b = replace(b, q=torch.randn(b.q.shape, dtype=b.q.dtype, device=DEVICE, generator=gen))
        o, lse = run_poisoned(wrapper, b)  # NaN-filled out/lse each run
        torch.cuda.synchronize()
        check_against_reference(case, b, o, lse)


def test_a_wrapper_dropped_before_its_upload_ran_keeps_its_plan_image():
    """The module uploads the plan image with its own async copy, which torch's pinned-memory cache
    does not see: a wrapper dropped right after run() must hold its host image until that copy ran,
    or the next plan() can be handed the same memory and refill it under the copy. A spinning
    kernel keeps the GPU busy, so both plans are filled before the first upload runs; the two
    batches have the same shape (the same image size) and different lengths."""
    first = Case(module=MODULES[1], layout="NHD", single_tensor=False, page_size=16, kv_lens=[900, 40, 2000, 7],
                 num_kv_heads=8, group=4, seed=1)
    second = replace(first, kv_lens=[33, 1500, 64, 800], seed=2)
    b1, b2 = make_batch(first), make_batch(second)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.25 s ahead of both uploads
    o1, lse1 = decode(first, b1)  # its wrapper is gone when decode() returns
    o2, lse2 = decode(second, b2)
    torch.cuda.synchronize()
    check_against_reference(first, b1, o1, lse1)
    check_against_reference(second, b2, o2, lse2)


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("group", [4, 16])
def test_cuda_graph_replays_of_a_split_batch_merge_every_time(group, debug, monkeypatch):
    """One plan, one capture, three replays with new q: the fused merge's counters reset themselves
    inside the graph (no plan() between replays). With ATTNFORGE_DEBUG=1 the capture checks the
    launches without synchronizing (which would invalidate it)."""
    monkeypatch.setenv("ATTNFORGE_DEBUG", "1" if debug else "0")
    case = _split_case(group)
    b = make_batch(case)
    batch = len(case.kv_lens)
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
        workspace_for(case), kv_layout=case.layout, use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indices_buffer=torch.empty(b.num_pages, dtype=torch.int32, device=DEVICE),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=DEVICE),
    )
    plan(wrapper, case, b)
    assert _num_partials(wrapper) > 1, "the batch must be split for the fused merge to run"
    q = b.q.clone()  # the graph's static input
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEVICE)
    side = torch.cuda.Stream()  # warm up off the default stream, as torch.cuda.graph expects
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, b.cache, out=out, lse=lse, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, b.cache, out=out, lse=lse, return_lse=True)

    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    for _ in range(3):
        q.copy_(torch.randn(q.shape, dtype=q.dtype, device=DEVICE, generator=gen))
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(case, b, out, lse, q=q)


@pytest.mark.parametrize("bad", ["num_pages", "far_out", "negative"])
def test_bad_page_id_gives_nan_for_that_request_only(bad):
    case = Case(module=MODULES[1], layout="NHD", single_tensor=False, page_size=16,
                kv_lens=[100, 37, 300, 5], num_kv_heads=2, group=4, spare_pages=3, seed=7)
    b = make_batch(case)
    victim = 2
    bad_id = {"num_pages": b.num_pages, "far_out": b.num_pages + 10**6, "negative": -1}[bad]
    indices = b.indices.clone()
    indices[int(b.indptr[victim]) + 1] = bad_id
    o, lse = decode(case, replace(b, indices=indices))
    torch.cuda.synchronize()  # a fault would surface here, and poison every later test
    assert o[victim].isnan().all(), "a request reading a page id out of range must give NaN"
    o_ref, lse_ref = reference_of(case, b)
    others = [r for r in range(len(case.kv_lens)) if r != victim]
    torch.testing.assert_close(o[others].float(), o_ref[others], **O_TOL[case.module.dtype])
    torch.testing.assert_close(lse[others], lse_ref[others], **LSE_TOL)


@pytest.mark.parametrize("use_tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_fixed_split_gives_a_request_the_same_bits_alone_and_in_a_full_batch(use_tensor_cores):
    """fixed_split_size applies whatever the batch (FlashInfer's meaning, which batch-invariant serving
    relies on): 128 requests of 1024 keys fill the GPU unsplit (128 x 8 kv heads >= any H100/H200's
    resident CTAs), yet each is cut into 64-key chunks as it is alone, so request 0's output comes out
    bit for bit the same in both plans."""
    batch, kv_len, page_size, kv_heads, group, head_dim = 128, 1024, 16, 8, 4, 128
    pages = kv_len // page_size
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    cache = tuple(torch.randn(batch * pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE,
                              generator=gen) for _ in range(2))
    q = torch.randn(batch, kv_heads * group, head_dim, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    indices = torch.randperm(batch * pages, device="cpu", generator=torch.Generator().manual_seed(6)).to(
        torch.int32).to(DEVICE)

    def run(requests: int) -> tuple[torch.Tensor, int]:
        wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE), use_tensor_cores=use_tensor_cores)
        indptr = torch.arange(requests + 1, dtype=torch.int32) * pages
        wrapper.plan(indptr, indices[: requests * pages], torch.full((requests,), page_size, dtype=torch.int32),
                     kv_heads * group, kv_heads, head_dim, page_size, q_data_type=torch.bfloat16,
                     fixed_split_size=4)
        out = torch.full((requests, kv_heads * group, head_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
        wrapper.run(q[:requests], cache, out=out)
        torch.cuda.synchronize()
        inner = wrapper._tensor_cores  # the tensor-core path's prefill wrapper holds the plan image
        partials = (inner._image.read_slot(PLAN_HEADER.index("num_partials")) if inner is not None
                    else _num_partials(wrapper))
        return out, partials

    (crowded, crowded_partials), (alone, alone_partials) = run(batch), run(1)
    assert alone_partials > 0 and crowded_partials == batch * alone_partials, "every request is cut alike"
    assert not crowded.isnan().any()
    assert torch.equal(crowded[:1], alone), "a request's bits must not depend on the batch around it"
