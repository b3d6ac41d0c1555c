"""FA3 batch prefill on the GPU where it differs from fa2: DeepSeek head dims, persistent CTAs and the
job counter, bad page ids, pages gathered ahead of the kernel, ragged tiles that must not read the
next request's keys, fa3 against fa2 on one batch and what backend="auto" picks. Cases, runs and
checks: prefill_cases.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, note

import attnforge
from attnforge.codegen.abi import PLAN_HEADER

from prefill_cases import (Batch, Case, DEVICE, E4M3, FA3, LSE_TOL, Module, O_TOL, PLAIN, WORKSPACE,
                           assert_matches_reference, build, cases, gpu_settings, run_ours, run_reference)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [16, 5], ids=["boxed", "gathered"])
def test_fa3_deepseek_head_dims_match_reference(page_size):
    """fa3 at (qk 192, vo 128): K rows of 24 16-byte cells, by TMA boxes (page 16) and by the
    cell-by-cell gather (pages of 5 rows, and every request's last tile)."""
    case = Case(Module(head_dim_qk=192, backend="fa3"), qo_lens=[300, 7], kv_lens=[1000, 90], causal=True, paged=True,
                layout="NHD", page_size=page_size, num_kv_heads=2, group=4, seed=page_size)
    batch = build(case)
    out, lse = run_ours(case, batch)
    assert_matches_reference(case, out, lse, *run_reference(case, batch))


def many_jobs_case(module: Module, causal: bool, seed: int) -> Case:
    """Far more (work item, kv head) jobs than the H200's 132 SMs, so each persistent fa3 CTA runs
    a dozen or more: lengths from one token to several tiles, requests without queries (no job of
    theirs has kv tiles), pages of 16 rows (boxed) with gathered last tiles."""
    rng = torch.Generator().manual_seed(seed)
    kv_lens = torch.randint(1, 1500, (40,), generator=rng).tolist()
    qo_lens = [min(kv, int(q)) for kv, q in zip(kv_lens, torch.randint(1, 400, (40,), generator=rng))]
    if not causal:
        qo_lens[3] = qo_lens[17] = 0
    return Case(module, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal, paged=True, layout="NHD", page_size=16,
                num_kv_heads=4, group=4, seed=seed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("module", FA3[:3], ids=["hd128", "hd64-fp16", "hd256"])
def test_fa3_persistent_ctas_match_reference(module, causal):
    """Each persistent CTA runs one job after another: its K/V stages, phases and Q buffer carry
    over from job to job, and the producer loads the next job while the consumers store this one.
    Also few q tiles split into 64-token chunks (split-KV): over a thousand short jobs, and under
    causal many without kv tiles (chunks past a tile's diagonal) among the others."""
    many = many_jobs_case(module, causal, seed=11 + causal)
    split = Case(module, qo_lens=[300, 1, 7], kv_lens=[1400, 900, 1100], causal=causal, paged=True, layout="NHD",
                 page_size=16, num_kv_heads=4, group=4, seed=3)
    for case, extra in ((many, {}), (split, {"fixed_split_size": 4})):
        batch = build(case)
        out, lse = run_ours(case, batch, **extra)
        assert_matches_reference(case, out, lse, *run_reference(case, batch))


def test_fa3_job_counter_is_zero_after_every_run():
    """CTAs take jobs from a counter in the plan image; the launch leaves it at 0, so the next
    run() (or a CUDA graph's replay) of the same plan runs every job again."""
    case = many_jobs_case(FA3[0], causal=True, seed=2)
    case.paged = False
    batch = build(case)
    o_ref, lse_ref = run_reference(case, batch)
    wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                             backend="fa3")
    wrapper.plan(batch.qo_indptr, batch.kv_indptr, case.num_qo_heads, case.num_kv_heads, 128, causal=True,
                 q_data_type=case.module.dtype)
    for _ in range(3):
        out = torch.full((batch.q.shape[0], case.num_qo_heads, 128), math.nan, dtype=case.module.dtype, device=DEVICE)
        out, lse = wrapper.run(batch.q, batch.k, batch.v, out=out, return_lse=True)
        assert_matches_reference(case, out, lse, o_ref, lse_ref)
        assert wrapper._image.read_slot(PLAN_HEADER.index("job_counter")) == 0


def rows_of_others(batch: Batch, request: int) -> torch.Tensor:
    """Every q row but `request`'s, as a bool mask over o's rows."""
    rows = batch.qo_indptr.tolist()
    others = torch.ones(rows[-1], dtype=torch.bool, device=DEVICE)
    others[rows[request]:rows[request + 1]] = False
    return others


@pytest.mark.parametrize("gather", [False, True], ids=["pages_read", "pages_gathered"])
def test_fa3_bad_page_id_gives_nan_for_that_request_only(gather, pages_gathered):
    """A page id out of range in one request: every job of that request (they run among the other
    requests' jobs on the persistent CTAs) gives NaN, and no other job does; the same when the pages
    are gathered ahead (the bad page's copied rows are NaN)."""
    gathered = pages_gathered(gather)
    case = many_jobs_case(FA3[0], causal=False, seed=5)
    batch = build(case)
    victim = 6
    page_ids = batch.page_ids.clone()
    page_ids[int(batch.page_indptr[victim])] = batch.cache[0].shape[0] + 7
    out, lse = run_ours(case, Batch(**{**batch.__dict__, "page_ids": page_ids}))
    torch.cuda.synchronize()  # a fault would surface here, and poison every later test
    assert len(gathered) == gather
    others = rows_of_others(batch, victim)
    assert out[~others].isnan().all() and lse[~others].isnan().all(), "the bad request's rows must be NaN"
    o_ref, lse_ref = run_reference(case, batch)
    assert_matches_reference(case, out[others], lse[others], o_ref[others], lse_ref[others])


def poison_rows_outside_requests(case: Case, batch: Batch) -> None:
    """NaN into every cache row no request owns: its last page's tail, and unused pages."""
    pool = batch.cache[0].shape[0]
    used = torch.zeros(pool, case.page_size, dtype=torch.bool)
    ids = batch.page_ids.tolist()
    for request, kv_len in enumerate(case.kv_lens):
        first = int(batch.page_indptr[request])
        for j in range(int(batch.page_indptr[request + 1]) - first):
            used[ids[first + j], : min(case.page_size, kv_len - j * case.page_size)] = True
    for cache in batch.cache:
        rows = cache if case.layout == "NHD" else cache.transpose(1, 2)  # [pool, page_size, heads, dim]
        rows[~used.to(DEVICE)] = math.nan


@pytest.mark.parametrize(("page_size", "layout"), [(1, "NHD"), (5, "HND"), (16, "NHD")],
                         ids=["page1", "page5-hnd", "page16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("module", FA3, ids=["hd128", "hd64-fp16", "hd256", "window-cap", "hd192"])
def test_fa3_pages_gathered_ahead_match_reference(module, causal, page_size, layout, pages_gathered):
    """A paged plan whose keys are read by many q tiles copies its pages into ragged K and V first and
    runs the ragged kernel over the copies (forced here on short lengths). Every cache row outside
    the requests is NaN: the copy takes whole pages, and no output may see past its request's keys.
    The lengths give a request without queries, requests shorter than a tile and partial last pages;
    kv chunks of about 256 tokens split the longer requests."""
    gathered = pages_gathered(True)
    case = Case(module, qo_lens=[40, 3 if causal else 0, 300, 9, 130], kv_lens=[300, 177, 1000, 5, 700],
                causal=causal, paged=True, layout=layout, page_size=page_size, num_kv_heads=2, group=4,
                seed=page_size, window_left=200 if module.window else -1, soft_cap=30.0 if module.soft_cap else None)
    batch = build(case)
    poison_rows_outside_requests(case, batch)
    out, lse = run_ours(case, batch, fixed_split_size=-(-256 // page_size))
    assert len(gathered) == 1
    assert_matches_reference(case, out, lse, *run_reference(case, batch))


def test_fa3_gathered_pages_match_reference_on_drawn_batches(pages_gathered):
    """Drawn paged batches (page sizes 1 to 256, NHD and HND, ragged lengths up to 16k keys, requests
    without queries, GQA groups 1 to 8) with their pages gathered ahead (forced) and every cache row
    outside the requests NaN."""
    gathered = pages_gathered(True)

    @gpu_settings(max_examples=20)
    @given(cases(FA3))
    def check(case):
        case = dataclasses.replace(case, paged=True)
        note(repr(case))
        batch = build(case)
        poison_rows_outside_requests(case, batch)
        plans = len(gathered)
        out, lse = run_ours(case, batch)
        assert len(gathered) == plans + 1
        assert_matches_reference(case, out, lse, *run_reference(case, batch))

    check()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("module", [FA3[0], FA3[3]], ids=["hd128", "window-cap"])
def test_fa3_ragged_tiles_read_only_their_requests_keys(module, causal, split):
    """A ragged request's partial last kv tile starts a whole tile before its end (over keys the tile
    before it took, masked there) rather than reading past it: NaN keys and values in one request
    leave every other request's output exact, next to it on either side, whole or split into chunks.
    The lengths give last tiles of 1, most and all of a tile's keys, and requests shorter than one."""
    case = Case(module, qo_lens=[40, 33, 70, 9, 50, 64], kv_lens=[300, 177, 1000, 90, 700, 128], causal=causal,
                paged=False, layout="NHD", page_size=1, num_kv_heads=2, group=4, seed=9,
                window_left=200 if module.window else -1, soft_cap=30.0 if module.soft_cap else None)
    batch = build(case)
    o_ref, lse_ref = run_reference(case, batch)
    for victim in (2, 4):
        k, v = batch.k.clone(), batch.v.clone()
        kv_rows = slice(int(batch.kv_indptr[victim]), int(batch.kv_indptr[victim + 1]))
        k[kv_rows], v[kv_rows] = math.nan, math.inf
        poisoned = Batch(**{**batch.__dict__, "k": k, "v": v})
        out, lse = run_ours(case, poisoned, **({"fixed_split_size": 250} if split else {}))  # ragged: tokens
        others = rows_of_others(batch, victim)
        assert_matches_reference(case, out[others], lse[others], o_ref[others], lse_ref[others])


@gpu_settings(max_examples=10)
@given(cases([PLAIN[0]]))
def test_fa3_equals_fa2(case):
    """The two kernel families on one batch: same maths, different tiles and summation order."""
    note(repr(case))
    batch = build(case)
    fa2 = run_ours(case, batch)
    fa3 = run_ours(Case(**{**case.__dict__, "module": FA3[0]}), batch)
    torch.testing.assert_close(fa3[0].float(), fa2[0].float(), **O_TOL[case.module.dtype])
    seen = torch.isfinite(fa2[1])
    assert torch.equal(torch.isfinite(fa3[1]), seen)
    torch.testing.assert_close(fa3[1][seen], fa2[1][seen], **LSE_TOL)


def test_auto_picks_fa3_on_hopper_and_fa2_for_what_fa3_refuses():
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    indptr = torch.tensor([0, 4], dtype=torch.int32)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    plain = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    plain.plan(indptr, indptr, 8, 2, 128, q_data_type=torch.bfloat16)
    assert plain._plan.module.spec.backend.value == ("fa3" if hopper else "fa2")
    rope = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    rope.plan(indptr, indptr, 8, 2, 128, pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.bfloat16)
    assert rope._plan.module.spec.backend.value == "fa2"
    fp8_kv = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace)  # FlashInfer #2148: bf16 q + fp8 KV is fa2's
    fp8_kv.plan(indptr, indptr, 8, 2, 128, q_data_type=torch.bfloat16, kv_data_type=E4M3)
    assert fp8_kv._plan.module.spec.backend.value == "fa2"
