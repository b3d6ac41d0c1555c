"""attnforge.page on CPU tensors against plain Python references: get_seq_lens,
get_batch_indices_positions (FlashInfer's documented example included) and append_paged_kv_cache
into NHD and HND caches, tuple and single-tensor forms, with padding entries skipped."""

from __future__ import annotations

import pytest
import torch

from attnforge import page


def _indptr(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def test_get_seq_lens_clamps_empty_requests():
    indptr, last = _indptr([3, 1, 0, 2]), torch.tensor([5, 16, 7, 1], dtype=torch.int32)
    expected = [max(p - 1, 0) * 16 + n for p, n in zip([3, 1, 0, 2], [5, 16, 7, 1])]
    assert page.get_seq_lens(indptr, last, 16).tolist() == expected


def test_batch_indices_positions_flashinfer_example():
    batch, positions = page.get_batch_indices_positions(_indptr([1, 2, 3, 4]), torch.full((4,), 5), 10)
    assert batch.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert positions.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    assert batch.dtype == positions.dtype == torch.int32


def test_batch_indices_positions_reference_with_padding_and_outputs():
    appends, seq_lens, nnz = [3, 0, 5, 1], [10, 4, 5, 1], 12
    expected_b, expected_p = [], []
    for b, (n, total) in enumerate(zip(appends, seq_lens)):
        expected_b += [b] * n
        expected_p += list(range(total - n, total))
    expected_b += [-1] * (nnz - len(expected_b))
    expected_p += [0] * (nnz - len(expected_p))
    out_b, out_p = torch.empty(nnz, dtype=torch.int32), torch.empty(nnz, dtype=torch.int32)
    batch, positions = page.get_batch_indices_positions(_indptr(appends), torch.tensor(seq_lens), nnz, out_b, out_p)
    assert batch is out_b and positions is out_p
    assert batch.tolist() == expected_b and positions.tolist() == expected_p


def _reference_append(k_cache, v_cache, key, value, batch, positions, indices, indptr, layout):
    """Token by token, as the page table says."""
    page_size = k_cache.shape[1] if layout == "NHD" else k_cache.shape[2]
    for i in range(key.shape[0]):
        b = int(batch[i])
        if b < 0:
            continue
        p = int(positions[i])
        page_id = int(indices[int(indptr[b]) + p // page_size])
        for cache, x in ((k_cache, key), (v_cache, value)):
            if layout == "NHD":
                cache[page_id, p % page_size] = x[i]
            else:
                cache[page_id, :, p % page_size] = x[i]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("single_tensor", [False, True])
def test_append_paged_kv_cache_matches_reference(layout, single_tensor):
    gen = torch.Generator().manual_seed(0)
    page_size, heads, dim, num_pages = 4, 2, 8, 12
    old_lens, appends = [5, 0, 7], [3, 6, 1]
    seq_lens = [a + b for a, b in zip(old_lens, appends)]
    pages = [-(-n // page_size) for n in seq_lens]
    indices = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = _indptr(pages)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(seq_lens, pages)], dtype=torch.int32)
    nnz = sum(appends) + 2  # two padding entries, as under CUDA graphs
    key = torch.randn(nnz, heads, dim, generator=gen)
    value = torch.randn(nnz, heads, dim, generator=gen)
    batch, positions = page.get_batch_indices_positions(_indptr(appends), page.get_seq_lens(indptr, last, page_size),
                                                        nnz)
    shape = (num_pages, page_size, heads, dim) if layout == "NHD" else (num_pages, heads, page_size, dim)
    if single_tensor:
        cache = torch.randn(num_pages, 2, *shape[1:], generator=gen)
        k_cache, v_cache = cache[:, 0], cache[:, 1]
        paged = cache
    else:
        k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        paged = (k_cache, v_cache)
    original_k = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    _reference_append(expected_k, expected_v, key, value, batch, positions, indices, indptr, layout)
    page.append_paged_kv_cache(key, value, batch, positions, paged, indices, indptr, last, layout)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not torch.equal(k_cache, original_k)  # the append wrote something


@pytest.mark.gpu
def test_append_is_captured_in_a_cuda_graph_and_replays():
    """Positions and the append, captured in a CUDA graph (so neither reads a device value on the host),
    replayed with new keys and lengths: the cache equals the token-by-token reference."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    page_size, heads, dim, num_pages, nnz = 4, 2, 8, 12, 12
    indices = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    indptr = _indptr([4, 4, 4]).cuda()
    last = torch.full((3,), page_size, dtype=torch.int32, device="cuda")
    append_indptr, seq_lens = _indptr([3, 6, 1]).cuda(), torch.tensor([10, 16, 2], dtype=torch.int32, device="cuda")
    key, value = (torch.randn(nnz, heads, dim, device="cuda", generator=gen) for _ in range(2))
    k_cache, v_cache = (torch.randn(num_pages, page_size, heads, dim, device="cuda", generator=gen) for _ in range(2))

    def append():
        batch, positions = page.get_batch_indices_positions(append_indptr, seq_lens, nnz)
        page.append_paged_kv_cache(key, value, batch, positions, (k_cache, v_cache), indices, indptr, last)
        return batch, positions

    append()  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch, positions = append()
    append_indptr.copy_(_indptr([1, 2, 5]))
    seq_lens.copy_(torch.tensor([16, 3, 9]))
    key.normal_(generator=gen), value.normal_(generator=gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    graph.replay()
    _reference_append(expected_k, expected_v, key, value, batch, positions, indices, indptr, "NHD")
    assert batch.tolist()[:8] == [0, 1, 1, 2, 2, 2, 2, 2]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_append_only_padding_leaves_the_cache_alone():
    k_cache, v_cache = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8)
    before = (k_cache.clone(), v_cache.clone())
    batch = torch.full((2,), -1, dtype=torch.int32)
    page.append_paged_kv_cache(torch.ones(2, 1, 8), torch.ones(2, 1, 8), batch, torch.zeros(2, dtype=torch.int32),
                               (k_cache, v_cache), torch.tensor([2], dtype=torch.int32), _indptr([1]),
                               torch.tensor([1], dtype=torch.int32))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("bad, text", [
    (dict(append_key=torch.ones(2, 3, 8)), "append_key: expected shape [nnz, 1, 8]"),
    (dict(append_value=torch.ones(2, 1, 8, dtype=torch.float16)), "append_value: expected dtype torch.float32"),
    (dict(positions=torch.zeros(3, dtype=torch.int32)), "positions: expected 2 entries"),
    (dict(kv_layout="NDH"), "kv_layout"),
])
def test_append_errors_name_the_argument(bad, text):
    args = dict(append_key=torch.ones(2, 1, 8), append_value=torch.ones(2, 1, 8),
                batch_indices=torch.zeros(2, dtype=torch.int32), positions=torch.zeros(2, dtype=torch.int32),
                paged_kv_cache=(torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)),
                kv_indices=torch.tensor([1], dtype=torch.int32), kv_indptr=_indptr([1]),
                kv_last_page_len=torch.tensor([2], dtype=torch.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=text.replace("[", r"\[")):
        page.append_paged_kv_cache(**args)
