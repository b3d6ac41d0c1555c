"""FlashInfer drop-in behaviour on a GPU (issue 37 items 1, 2, 5): engine call sequences against
attnforge's reference or against the equivalent plain plan()/run().

    vLLM/SGLang-style graph decode: CUDAGraphBatchDecodeWithPagedKVCacheWrapper, fast_decode_plan each
        step (engine writes the indices buffer, passes global_override_indptr_cpu), capture + replay
    SGLang-style prefill: begin_forward with defaults, forward_return_lse(causal=..., sm_scale=...)
        on ragged and paged, merge_state
    append_paged_kv_cache on the device (equal to the CPU path), then decode over the appended cache
    single_prefill_with_kv_cache(k_scale=, v_scale=) and its _return_lse form
Modules: fa2 decode and fa2 prefill, bf16, head dim 128, no window/soft cap (one build each).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import attnforge
from attnforge import reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HQ, HKV, HD, PAGE, NUM_PAGES = 8, 2, 128, 16, 64
TOL = dict(atol=2e-2, rtol=2e-2)


def _indptr(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _page_table(kv_lens, gen):
    pages = [-(-n // PAGE) for n in kv_lens]
    indices = torch.randperm(NUM_PAGES, generator=gen)[: sum(pages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return _indptr(pages), indices, last


def _workspace() -> torch.Tensor:
    return torch.zeros(128 << 20, dtype=torch.uint8, device=DEVICE)


@pytest.fixture(scope="module")
def cache():
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(NUM_PAGES, PAGE, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16) for _ in "kv")


def _decode_reference(q, cache, indptr, indices, last, **kwargs):
    o, _ = reference.batch_decode_paged(q, cache, indptr, indices.to(DEVICE), last, **kwargs)
    return o


def test_graph_decode_fast_plan_capture_and_replay(cache):
    """Graph wrapper over engine buffers; each step the engine writes the page ids into the indices
    buffer and calls fast_decode_plan with a host indptr; the captured graph replays each step's plan."""
    gen = torch.Generator().manual_seed(1)
    batch = 4
    indptr_buf = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    indices_buf = torch.zeros(NUM_PAGES, dtype=torch.int32, device=DEVICE)
    last_buf = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    w = attnforge.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_workspace(), indptr_buf, indices_buf, last_buf)
    assert w.is_cuda_graph_enabled
    assert w._paged_kv_indptr_buf is indptr_buf and w._paged_kv_indices_buf is indices_buf
    assert w._paged_kv_last_page_len_buf is last_buf and w._qo_indptr_buf is None
    q = torch.randn(batch, HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.empty_like(q)

    indptr, indices, last = _page_table([40, 1, 17, 64], gen)
    w.plan(indptr, indices, last, HQ, HKV, HD, PAGE, q_data_type=torch.bfloat16)  # a full plan fills the buffers
    assert torch.equal(indptr_buf.cpu(), indptr) and torch.equal(last_buf.cpu(), last)
    assert torch.equal(indices_buf[: indices.numel()].cpu(), indices)
    w.plan = functools.partial(attnforge.fast_decode_plan, w)
    graph = torch.cuda.CUDAGraph()
    w.run(q, cache, out=out)  # warm up outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out)
    for step, kv_lens in enumerate(([41, 2, 18, 65], [100, 33, 5, 300], [7, 7, 7, 7])):
        indptr, indices, last = _page_table(kv_lens, gen)
        indices_buf[: indices.numel()].copy_(indices)  # the engine writes the buffer itself
        indptr_buf.copy_(indptr)
        last_buf.copy_(last)
        w.plan(indptr_buf, indices_buf, last_buf, HQ, HKV, HD, PAGE, "NONE", -1, None, torch.bfloat16,
               global_override_indptr_cpu=indptr)
        graph.replay()
        torch.cuda.synchronize()
        expected = _decode_reference(q, cache, indptr, indices, last)
        torch.testing.assert_close(out.float(), expected, **TOL, msg=f"step {step}")


def test_decode_data_type_and_positional_plan(cache):
    gen = torch.Generator().manual_seed(2)
    indptr, indices, last = _page_table([30, 90, 5], gen)
    q = torch.randn(3, HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    w = attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    # positionally: pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type,
    # data_type, sm_scale
    w.plan(indptr, indices, last, HQ, HKV, HD, PAGE, "NONE", -1, None, None, None, None, torch.bfloat16, 0.05)
    torch.testing.assert_close(w.run(q, cache).float(),
                               _decode_reference(q, cache, indptr, indices, last, sm_scale=0.05), **TOL)
    o, lse = w.run_return_lse(q, cache)
    _, expected_lse = reference.batch_decode_paged(q, cache, indptr, indices.to(DEVICE), last, sm_scale=0.05)
    torch.testing.assert_close(lse, expected_lse, **TOL)


def test_decode_forward_sm_scale_replaces_the_planned_one(cache):
    gen = torch.Generator().manual_seed(3)
    indptr, indices, last = _page_table([30, 90, 5], gen)
    q = torch.randn(3, HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    w = attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    w.begin_forward(indptr, indices, last, HQ, HKV, HD, PAGE, data_type=torch.bfloat16, q_data_type=torch.bfloat16)
    got = w.forward(q, cache, sm_scale=0.2)
    torch.testing.assert_close(got.float(), _decode_reference(q, cache, indptr, indices, last, sm_scale=0.2), **TOL)
    o, lse = w.forward_return_lse(q, cache, sm_scale=0.2)
    torch.testing.assert_close(o, got, atol=1e-3, rtol=1e-3)
    w.end_forward()


def test_sglang_style_prefill_forward_and_merge(cache):
    """SGLang: begin_forward without causal, then forward_return_lse(causal=True) over the new tokens
    (ragged) and (causal=False) over the cached prefix (paged), merged with merge_state."""
    gen = torch.Generator().manual_seed(4)
    prefix_lens, new_lens = [20, 0, 45], [5, 12, 1]
    indptr, indices, last = _page_table([max(n, 1) for n in prefix_lens], gen)
    qo_indptr = _indptr(new_lens)
    q = torch.randn(sum(new_lens), HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(sum(new_lens), HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(sum(new_lens), HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    scale = HD ** -0.5 * 0.9

    ragged = attnforge.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    ragged.begin_forward(qo_indptr, qo_indptr, HQ, HKV, HD, q_data_type=torch.bfloat16)
    o1, s1 = ragged.forward_return_lse(q, k, v, causal=True, sm_scale=scale, logits_soft_cap=None)
    expected1, expected_s1 = reference.batch_prefill_ragged(q, k, v, qo_indptr, qo_indptr, causal=True,
                                                            sm_scale=scale, o_dtype=torch.float32)
    torch.testing.assert_close(o1.float(), expected1, **TOL)
    torch.testing.assert_close(s1, expected_s1, **TOL)

    paged = attnforge.BatchPrefillWithPagedKVCacheWrapper(_workspace())
    paged.begin_forward(qo_indptr, indptr, indices, last, HQ, HKV, HD, PAGE, q_data_type=torch.bfloat16,
                        kv_data_type=torch.bfloat16, non_blocking=True)
    o2, s2 = paged.forward_return_lse(q, cache, causal=False, sm_scale=scale, logits_soft_cap=0.0)
    plain = attnforge.BatchPrefillWithPagedKVCacheWrapper(_workspace())
    plain.plan(qo_indptr, indptr, indices, last, HQ, HKV, HD, PAGE, sm_scale=scale, q_data_type=torch.bfloat16)
    expected2, expected_s2 = plain.run(q, cache, return_lse=True)
    torch.testing.assert_close(o2, expected2, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(s2, expected_s2, atol=1e-3, rtol=1e-3)
    o, s = attnforge.cascade.merge_state(o1, s1, o2, s2)
    assert o.shape == q.shape and torch.isfinite(s).all()

    # paged forward(causal=True) after a non-causal plan plans again, and equals a causal plan
    causal = attnforge.BatchPrefillWithPagedKVCacheWrapper(_workspace())
    causal.plan(qo_indptr, indptr, indices, last, HQ, HKV, HD, PAGE, causal=True, q_data_type=torch.bfloat16)
    torch.testing.assert_close(paged.forward(q, cache, causal=True), causal.run(q, cache), atol=1e-3, rtol=1e-3)


def test_append_paged_kv_cache_then_decode():
    gen = torch.Generator().manual_seed(5)
    old_lens, appends = [17, 0, 40], [3, 9, 1]
    seq_lens = [a + b for a, b in zip(old_lens, appends)]
    indptr, indices, last = _page_table(seq_lens, gen)
    for layout in ("NHD", "HND"):
        shape = (NUM_PAGES, PAGE, HKV, HD) if layout == "NHD" else (NUM_PAGES, HKV, PAGE, HD)
        cpu_cache = torch.randn(NUM_PAGES, 2, *shape[1:], generator=gen).to(torch.bfloat16)
        gpu_cache = cpu_cache.to(DEVICE)
        key = torch.randn(sum(appends), HKV, HD, generator=gen).to(torch.bfloat16)
        value = torch.randn(sum(appends), HKV, HD, generator=gen).to(torch.bfloat16)
        lens = attnforge.get_seq_lens(indptr.to(DEVICE), last.to(DEVICE), PAGE)
        batch, pos = attnforge.get_batch_indices_positions(_indptr(appends).to(DEVICE), lens, sum(appends))
        attnforge.append_paged_kv_cache(key.to(DEVICE), value.to(DEVICE), batch, pos, gpu_cache,
                                        indices.to(DEVICE), indptr.to(DEVICE), last.to(DEVICE), layout)
        attnforge.page.append_paged_kv_cache(key, value, batch.cpu(), pos.cpu(), cpu_cache, indices, indptr, last,
                                             layout)
        assert torch.equal(gpu_cache.cpu(), cpu_cache)
        w = attnforge.BatchDecodeWithPagedKVCacheWrapper(_workspace(), layout)
        w.plan(indptr, indices, last, HQ, HKV, HD, PAGE, q_data_type=torch.bfloat16)
        q = torch.randn(3, HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
        expected, _ = reference.batch_decode_paged(q, gpu_cache, indptr, indices.to(DEVICE), last, kv_layout=layout)
        torch.testing.assert_close(w.run(q, gpu_cache).float(), expected, **TOL)


def test_single_prefill_float_kv_scales_and_return_lse():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(9, HQ, HD, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(33, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(33, HKV, HD, generator=gen).to(DEVICE, torch.bfloat16)
    o, lse = attnforge.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True, k_scale=0.5, v_scale=2.0)
    base_o, base_lse = attnforge.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=0.5 / math.sqrt(HD),
                                                              return_lse=True)
    torch.testing.assert_close(o.float(), base_o.float() * 2.0, **TOL)
    torch.testing.assert_close(lse, base_lse, atol=1e-3, rtol=1e-3)
