"""FA3 fp8 (e4m3 or e5m2 q, k, v; bf16 o) prefill on the GPU against attnforge.reference fed the dequantized
inputs (fp8 value * scale, fp32): what is left is the e4m3 rounding of P, the fp8 wgmma's
reduced-precision accumulation and the bf16 output.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnforge
from attnforge import prefill_plan_steps as plan_steps
from attnforge import reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
WORKSPACE = 256 << 20
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# P in e4m3 keeps 3 mantissa bits (relative rounding up to 2^-4, random in sign), so o's relative
# L2 error is a few percent of that at most; max abs is bounded in units of max |v|.
REL_L2_TOL = 3e-2
MAX_ABS_TOL = 0.1


FLOAT_SCALES = dict(q_scale=0.5, k_scale=2.0, v_scale=0.75)


def per_head_scales() -> dict:
    """float32 tensors of one scale per head, for 8 query and 2 kv heads."""
    return dict(q_scale=torch.linspace(0.25, 2.0, 8, device=DEVICE), k_scale=torch.tensor([0.5, 1.5], device=DEVICE),
                v_scale=torch.tensor([2.0, 0.75], device=DEVICE))


def broadcast(scale):
    """A float scale as is; a per-head tensor [H] as [1, H, 1], to scale [tokens, H, dim] tensors."""
    return scale.view(1, -1, 1) if isinstance(scale, torch.Tensor) else scale


def quantized(shape, scale, gen, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """fp32 randn divided by `scale` (a float, or one per head) and rounded to fp8: the tensor
    stands for fp8 value * scale."""
    return (torch.randn(shape, device=DEVICE, generator=gen) / broadcast(scale)).to(dtype)


def error_stats(out: torch.Tensor, o_ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max abs) error of o against the fp32 reference."""
    diff = out.float() - o_ref.float()
    return (diff.norm() / o_ref.float().norm().clamp_min(1e-30)).item(), diff.abs().max().item()


def pages_of(kv_lens: list[int], page_size: int, gen) -> tuple:
    """Shuffled page ids for the requests: (pages per request, ids, page indptr, last page lengths)."""
    pages = [math.ceil(n / page_size) for n in kv_lens]
    ids = torch.randperm(sum(pages) + 2, device=DEVICE, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return pages, ids, indptr, last


def paged_copy(dense: torch.Tensor, kv_lens: list[int], pages: list[int], ids: torch.Tensor, page_size: int):
    """A ragged [total_kv, H, D] tensor laid out in the pages `ids` of a [pool, page_size, H, D] cache
    whose other rows (unused pages, last pages' tails) hold NaN: no output may see them."""
    paged = torch.full((len(ids) + 2, page_size, *dense.shape[1:]), math.nan, dtype=dense.dtype, device=DEVICE)
    start, page = 0, 0
    for n, p in zip(kv_lens, pages):
        for j in range(p):
            rows = dense[start + j * page_size: start + min(n, (j + 1) * page_size)]
            paged[int(ids[page + j]), : rows.shape[0]] = rows
        start, page = start + n, page + p
    return paged


def indptr_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def run_fa3_fp8(q, k, v, qo_lens, kv_lens, heads, scales, page_size: int | None, causal: bool, gen,
                positional: bool = False, fixed_split_size: int | None = None):
    """fa3 fp8 prefill, ragged (page_size None) or paged, into a NaN-poisoned output; the scales as
    keywords, or positionally (FlashInfer's fa3 form run(q, kv..., q_scale, k_scale, v_scale))."""
    args = (scales["q_scale"], scales["k_scale"], scales["v_scale"]) if positional else ()
    kwargs = {} if positional else scales
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    head_dim = q.shape[-1]
    types = dict(q_data_type=q.dtype, kv_data_type=k.dtype, o_data_type=torch.bfloat16, causal=causal,
                 fixed_split_size=fixed_split_size)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device=DEVICE)
    if page_size is not None:
        pages, ids, page_indptr, last = pages_of(kv_lens, page_size, gen)
        cache = tuple(paged_copy(x, kv_lens, pages, ids, page_size) for x in (k, v))
        wrapper = attnforge.BatchPrefillWithPagedKVCacheWrapper(workspace, backend="fa3")
        wrapper.plan(indptr_of(qo_lens), page_indptr, ids, last, *heads, head_dim, page_size, **types)
        return wrapper.run(q, cache, *args, out=out, return_lse=True, **kwargs)
    wrapper = attnforge.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend="fa3")
    wrapper.plan(indptr_of(qo_lens), indptr_of(kv_lens), *heads, head_dim, **types)
    return wrapper.run(q, k, v, *args, out=out, return_lse=True, **kwargs)


# Ragged and page 16 box every tile by TMA but the last; page 200 mixes boxed tiles with tiles
# that cross a page (gathered); pages of 1 and 5 rows gather every tile.
LAYOUTS = {"ragged": None, "page16": 16, "page200": 200}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kv_len", [300, 4096, 16384, 32768])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa3_fp8_matches_dequantized_reference(head_dim, kv_len, layout, capsys):
    """Causal batch (a decode row, a short and a long prefill; GQA 4) at context lengths up to 32k:
    error statistics printed for the issue and bounded."""
    check_against_reference(head_dim, kv_len, LAYOUTS[layout], capsys)


def planned_v_blocks(monkeypatch, ahead: bool = True) -> list:
    """What plan() decides about V transposed ahead, recorded per plan (None: the kernel transposes);
    ahead=False forces the kernel's transposes."""
    planned = []
    real = plan_steps.transposed_v_blocks

    def record(*args):
        planned.append(real(*args) if ahead else None)
        return planned[-1]

    monkeypatch.setattr(plan_steps, "transposed_v_blocks", record)
    return planned


@pytest.mark.parametrize("ahead", [True, False], ids=["v_transposed_ahead", "kernel_transposes"])
@pytest.mark.parametrize(("layout", "gather"), [("ragged", False), ("page16", False), ("page16", True),
                                                ("page200", False), ("page200", True)],
                         ids=["ragged", "page16", "page16-gathered", "page200", "page200-gathered"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa3_fp8_v_transposed_ahead_or_not_matches_dequantized_reference(head_dim, layout, gather, ahead, monkeypatch,
                                                                         pages_gathered):
    """A prefill plan whose requests read V from several q tiles has it transposed once, ahead of the
    kernel (transposed_v_blocks); else (here forced) the kernel transposes each tile. Both on a causal
    batch with fewer queries than keys, cut into 300-key chunks (a chunk's first tile then reaches back
    before it), whose middle request's K and V are NaN: the rows of the others must not see them (a
    ragged request's last tile reads K past its end). Paged plans also with their pages gathered into
    ragged K and V first (forced), which V^T is then transposed from."""
    gathered = pages_gathered(gather)
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)
    qo_lens, kv_lens, heads = [300, 5, 600], [1000, 333, 2000], (8, 2)
    q = quantized((sum(qo_lens), heads[0], head_dim), FLOAT_SCALES["q_scale"], gen)
    k, v = (quantized((sum(kv_lens), heads[1], head_dim), FLOAT_SCALES[name], gen) for name in ("k_scale", "v_scale"))
    poisoned = slice(kv_lens[0], kv_lens[0] + kv_lens[1])
    k[poisoned], v[poisoned] = math.nan, math.nan
    planned = planned_v_blocks(monkeypatch, ahead)
    out, lse = run_fa3_fp8(q, k, v, qo_lens, kv_lens, heads, FLOAT_SCALES, LAYOUTS[layout], causal=True, gen=gen,
                           fixed_split_size=300)
    assert len(planned) == 1 and (planned[0] is not None) == ahead
    assert len(gathered) == gather
    o_ref, lse_ref = dequantized_reference(q, k, v, FLOAT_SCALES, qo_lens, kv_lens, causal=True)
    v_seen = torch.cat((v[: poisoned.start], v[poisoned.stop:]))
    for rows in (slice(0, qo_lens[0]), slice(qo_lens[0] + qo_lens[1], None)):
        assert_matches_reference(out[rows], lse[rows], o_ref[rows], lse_ref[rows], v_seen, FLOAT_SCALES["v_scale"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fa3_fp8_v_transposed_ahead_of_fewer_keys_than_a_tile_matches_dequantized_reference(layout, capsys,
                                                                                              monkeypatch):
    """Requests of two q tiles each (V transposed ahead) over fewer keys than one tile in all: the
    ragged K map's box is then shorter than a tile, K is gathered, and the launch takes the kernel
    that transposes V itself (paged: pages gathered into the V-transposed-ahead kernel). 256 and 224
    packed rows are two tiles of 128 rows (two warpgroups) and of 192 (three)."""
    planned = planned_v_blocks(monkeypatch)
    check_against_reference(128, 0, LAYOUTS[layout], capsys, lens=([64, 56], [50, 30]))
    assert len(planned) == 1 and planned[0] is not None


@pytest.mark.parametrize("page_size", [1, 5])
def test_fa3_fp8_gathered_pages_match_dequantized_reference(page_size, capsys):
    check_against_reference(128, 300, page_size, capsys)


@pytest.mark.parametrize("layout", ["ragged", "page16"])
def test_fa3_fp8_per_head_scales_match_dequantized_reference(layout, capsys):
    """Tensor scales, one per head: each head quantized with its own, the kernel reading them."""
    check_against_reference(128, 4096, LAYOUTS[layout], capsys, per_head_scales())


def test_fa3_fp8_single_value_tensor_scales_equal_float_scales():
    """[1] tensors passed positionally give what the same floats as keywords give."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    qo_lens, kv_lens, heads = [33, 500], [700, 2000], (8, 2)
    q, k, v = (quantized((sum(n), h, 128), 1.0, gen) for n, h in ((qo_lens, 8), (kv_lens, 2), (kv_lens, 2)))
    tensors = {name: torch.tensor([value], device=DEVICE) for name, value in FLOAT_SCALES.items()}
    o_float, lse_float = run_fa3_fp8(q, k, v, qo_lens, kv_lens, heads, FLOAT_SCALES, None, causal=True, gen=gen)
    o_tensor, lse_tensor = run_fa3_fp8(q, k, v, qo_lens, kv_lens, heads, tensors, None, causal=True, gen=gen,
                                       positional=True)
    torch.testing.assert_close(o_tensor.float(), o_float.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_tensor, lse_float, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("layout", ["ragged", "page16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa3_e5m2_matches_dequantized_reference(head_dim, layout, capsys):
    """e5m2 q, k, v: Q.K^T in e5m2, P (e4m3) times e5m2 V."""
    check_against_reference(head_dim, 4096, LAYOUTS[layout], capsys, dtype=E5M2)


@pytest.mark.parametrize("layout", ["page16", "page200"])
def test_fa3_fp8_as_many_queries_as_requests_matches_dequantized_reference(layout, capsys):
    """A paged plan with as many query tokens as requests takes the decode instantiation even when
    the tokens are not one per request: requests of 2 and 3 tokens (8 and 12 packed rows at group
    4, so both of warp 0's row halves live), empty ones, and the rest of one."""
    lens = ([2, 0, 1, 0, 3, 1, 1, 1, 0], [300, 50, 1000, 7, 4096, 129, 16, 2000, 64])
    check_against_reference(128, 0, LAYOUTS[layout], capsys, lens=lens)


@pytest.mark.parametrize("layout", ["page16", "page200"])
def test_fa3_fp8_one_token_requests_match_dequantized_reference(layout, capsys):
    """A paged prefill plan of one query token per request (group 4) takes the decode kernel with
    the keys along M: requests of 1 to 4096 keys (a partial tile alone, whole tiles, a gathered last
    tile), boxed pages and gathered ones (200)."""
    lens = ([1] * 8, [1, 7, 128, 129, 4096, 300, 2000, 64])
    check_against_reference(128, 0, LAYOUTS[layout], capsys, lens=lens)


@pytest.mark.parametrize("group", [1, 4, 8, 12, 16, 64, 80, 160])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa3_fp8_tensor_core_decode_matches_dequantized_reference(head_dim, group):
    """Tensor-core decode on fa3 fp8 (the kernel's decode instantiations) against the reference, at
    groups of at most 8 rows (hd 128: the keys along M; hd 256: part of warp 0, its second half of
    rows idle), all of warp 0 (12, 16), all of consumer warpgroup 0 (64), or spilling into
    warpgroup 1 (80: both compute, the producer transposes V); 160 rows are more than a decode
    instantiation's tile (hd 128: one 192-row prefill tile, left to the prefill kernel; hd 256: two of
    the decode instantiation's 128-row tiles)."""
    gen = torch.Generator(device=DEVICE).manual_seed(group + head_dim)
    batch, kv_heads, page_size = 9, 2, 16
    kv_lens = torch.randint(1, 3000, (batch,), generator=torch.Generator().manual_seed(group)).tolist()
    pages, ids, page_indptr, last = pages_of(kv_lens, page_size, gen)
    q = quantized((batch, kv_heads * group, head_dim), FLOAT_SCALES["q_scale"], gen)
    k = quantized((sum(kv_lens), kv_heads, head_dim), FLOAT_SCALES["k_scale"], gen)
    v = quantized((sum(kv_lens), kv_heads, head_dim), FLOAT_SCALES["v_scale"], gen)
    cache = tuple(paged_copy(x, kv_lens, pages, ids, page_size) for x in (k, v))
    decode = attnforge.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE),
                                                          use_tensor_cores=True, backend="fa3")
    decode.plan(page_indptr, ids, last, kv_heads * group, kv_heads, head_dim, page_size, q_data_type=E4M3,
                kv_data_type=E4M3, o_data_type=torch.bfloat16)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device=DEVICE)
    out, lse = decode.run(q, cache, out=out, return_lse=True, **FLOAT_SCALES)
    o_ref, lse_ref = dequantized_reference(q, k, v, FLOAT_SCALES, [1] * batch, kv_lens, causal=False)
    assert_matches_reference(out, lse, o_ref, lse_ref, v, FLOAT_SCALES["v_scale"])


@pytest.mark.parametrize("group", [4, 16])
def test_fa3_fp8_tensor_core_decode_cuda_graph_replays_after_replan(group):
    """Tensor-core decode on fa3 fp8 captured in a CUDA graph, then re-planned with other lengths and
    pages (same batch) and replayed: the kernel the capture chose (group 4: the keys along M, which
    only a decode wrapper's graph may take; 16: the 64-row decode kernel) serves both plans."""
    gen = torch.Generator(device=DEVICE).manual_seed(group)
    batch, kv_heads, dim, page_size, pool = 12, 2, 128, 16, 2000
    cache = tuple(quantized((pool, page_size, kv_heads, dim), FLOAT_SCALES[name], gen) for name in ("k_scale", "v_scale"))
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE), use_cuda_graph=True, use_tensor_cores=True,
        backend="fa3", paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indices_buffer=torch.empty(pool, dtype=torch.int32, device=DEVICE),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=DEVICE))
    q = torch.empty((batch, kv_heads * group, dim), dtype=E4M3, device=DEVICE)  # the graph's static input
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEVICE)

    def plan(seed: int):
        """A new plan and query; returns the dense K and V its requests see, and their lengths."""
        rng = torch.Generator().manual_seed(seed)
        kv_lens = torch.randint(1, 2500, (batch,), generator=rng).tolist()
        pages = [math.ceil(n / page_size) for n in kv_lens]
        ids = torch.randperm(pool, generator=rng)[: sum(pages)].to(torch.int32)
        last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        wrapper.plan(indptr_of(pages), ids, last, kv_heads * group, kv_heads, dim, page_size, q_data_type=E4M3,
                     kv_data_type=E4M3, o_data_type=torch.bfloat16)
        q.copy_(quantized(q.shape, FLOAT_SCALES["q_scale"], gen))
        starts = indptr_of(pages).tolist()
        dense = tuple(torch.cat([c[ids[starts[r]:starts[r + 1]].long()].flatten(0, 1)[: kv_lens[r]] for r in range(batch)])
                      for c in cache)
        return dense, kv_lens

    dense, kv_lens = plan(1)
    side = torch.cuda.Stream()  # warm up off the default stream, as torch.cuda.graph expects
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **FLOAT_SCALES)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **FLOAT_SCALES)
    for replan in (False, True):
        if replan:
            dense, kv_lens = plan(2)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = dequantized_reference(q, *dense, FLOAT_SCALES, [1] * batch, kv_lens, causal=False)
        assert_matches_reference(out, lse, o_ref, lse_ref, dense[1], FLOAT_SCALES["v_scale"])


def check_against_reference(head_dim: int, kv_len: int, page_size: int | None, capsys,
                            scales: dict = FLOAT_SCALES, dtype: torch.dtype = E4M3,
                            lens: tuple[list[int], list[int]] | None = None) -> None:
    """A causal batch, by default a decode row, a short and a long prefill over kv_len keys each;
    `lens` (qo_lens, kv_lens) replaces it."""
    gen = torch.Generator(device=DEVICE).manual_seed(kv_len + head_dim)
    qo_lens, kv_lens = lens or ([1, 77, 700], [kv_len] * 3)
    heads = (8, 2)
    q = quantized((sum(qo_lens), heads[0], head_dim), scales["q_scale"], gen, dtype)
    k = quantized((sum(kv_lens), heads[1], head_dim), scales["k_scale"], gen, dtype)
    v = quantized((sum(kv_lens), heads[1], head_dim), scales["v_scale"], gen, dtype)
    out, lse = run_fa3_fp8(q, k, v, qo_lens, kv_lens, heads, scales, page_size, causal=True, gen=gen)
    o_ref, lse_ref = dequantized_reference(q, k, v, scales, qo_lens, kv_lens, causal=True)
    seen = torch.isfinite(lse_ref)  # causal rows past their request's keys: -inf in both

    def report(rel_l2: float, max_abs: float) -> None:
        with capsys.disabled():
            kind = "per-head" if isinstance(scales["q_scale"], torch.Tensor) else "float"
            print(f"\n[fa3 {str(dtype)[-6:]} prefill] hd={head_dim} kv_len={kv_len} page_size={page_size} {kind} scales: o relative L2 {rel_l2:.3e}, "
                  f"max abs {max_abs:.3e}, lse max abs {(lse - lse_ref)[seen].abs().max().item():.3e} (rows that see a key)")

    assert_matches_reference(out, lse, o_ref, lse_ref, v, scales["v_scale"], report)


def dequantized_reference(q, k, v, scales: dict, qo_lens: list[int], kv_lens: list[int], causal: bool):
    """attnforge.reference on the dequantized inputs (fp8 value * scale, fp32): (o, lse)."""
    return reference.batch_prefill_ragged(
        *(x.float() * broadcast(scales[name]) for x, name in ((q, "q_scale"), (k, "k_scale"), (v, "v_scale"))),
        indptr_of(qo_lens), indptr_of(kv_lens), causal=causal, o_dtype=torch.float32)


def assert_matches_reference(out, lse, o_ref, lse_ref, v, v_scale, report=None) -> None:
    """A bf16 o free of NaN within the e4m3-P bounds of the reference (relative L2, max abs in units
    of max |v|), and lse within 2e-2; `report(rel_l2, max_abs)`, if given, sees the errors first."""
    assert out.dtype is torch.bfloat16 and not out.isnan().any()
    rel_l2, max_abs = error_stats(out, o_ref)
    if report is not None:
        report(rel_l2, max_abs)
    assert rel_l2 <= REL_L2_TOL
    assert max_abs <= MAX_ABS_TOL * (v.float() * broadcast(v_scale)).abs().max().item()
    torch.testing.assert_close(lse, lse_ref, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["ragged", "page16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa3_fp8_rising_scores_match_dequantized_reference(head_dim, layout, causal):
    """Keys whose scores grow along the sequence, a little per tile and then in one late jump: a row's
    running max moves only when a tile exceeds it by more than the lag (P, e4m3, must hold the weights
    until then). o and lse must still be the reference's, for a decode row, a partial q tile and two."""
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim + causal)
    qo_lens, kv_lens, heads = [1, 37, 200], [3000] * 3, (8, 2)
    growth = torch.linspace(0.2, 3.0, kv_lens[0], device=DEVICE)
    growth[-100:] = 6.0  # the max jumps by far more than any lag
    q = quantized((sum(qo_lens), heads[0], head_dim), FLOAT_SCALES["q_scale"], gen)
    k = (quantized((sum(kv_lens), heads[1], head_dim), FLOAT_SCALES["k_scale"], gen).float()
         * growth.repeat(len(kv_lens))[:, None, None]).to(E4M3)
    v = quantized((sum(kv_lens), heads[1], head_dim), FLOAT_SCALES["v_scale"], gen)
    out, lse = run_fa3_fp8(q, k, v, qo_lens, kv_lens, heads, FLOAT_SCALES, LAYOUTS[layout], causal=causal, gen=gen)
    o_ref, lse_ref = dequantized_reference(q, k, v, FLOAT_SCALES, qo_lens, kv_lens, causal=causal)
    assert_matches_reference(out, lse, o_ref, lse_ref, v, FLOAT_SCALES["v_scale"])


@pytest.mark.parametrize("layout", ["ragged", "page16"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa3_fp8_persistent_ctas_match_dequantized_reference(head_dim, layout, capsys):
    """60 requests of up to 1500 keys: several jobs per persistent CTA, so the producer's V staging
    buffers and every stage's phase carry over from job to job."""
    rng = torch.Generator().manual_seed(head_dim)
    kv_lens = torch.randint(1, 1500, (60,), generator=rng).tolist()
    qo_lens = [min(kv, int(q)) for kv, q in zip(kv_lens, torch.randint(1, 500, (60,), generator=rng))]
    check_against_reference(head_dim, 0, LAYOUTS[layout], capsys, lens=(qo_lens, kv_lens))


@pytest.mark.parametrize("per_head", [False, True], ids=["float_scales", "per_head_scales"])
@pytest.mark.parametrize("group", [1, 8])
def test_tensor_core_decode_on_fa3_fp8_equals_prefill(group, per_head):
    """Decode through the fa3 fp8 prefill kernels equals paged prefill with one query per request on
    the same cache: the same kernel, so only the plan differs (per-head scales: passed positionally
    to decode, as keywords to prefill)."""
    gen = torch.Generator(device=DEVICE).manual_seed(group)
    batch, kv_heads, dim, page_size = 17, 2, 128, 16
    kv_lens = torch.randint(1, 5000, (batch,), generator=torch.Generator().manual_seed(group)).tolist()
    pages, ids, page_indptr, last = pages_of(kv_lens, page_size, gen)
    k = quantized((sum(kv_lens), kv_heads, dim), 1.0, gen)
    v = quantized((sum(kv_lens), kv_heads, dim), 1.0, gen)
    cache = tuple(paged_copy(x, kv_lens, pages, ids, page_size) for x in (k, v))
    q = quantized((batch, kv_heads * group, dim), 1.0, gen)
    scales = dict(q_scale=1.0, k_scale=0.5, v_scale=1.5)
    if per_head:
        scales = dict(q_scale=torch.linspace(0.5, 1.5, kv_heads * group, device=DEVICE),
                      k_scale=torch.tensor([0.5, 1.25], device=DEVICE), v_scale=torch.tensor([1.5, 0.5], device=DEVICE))
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=DEVICE)
    decode = attnforge.BatchDecodeWithPagedKVCacheWrapper(workspace, use_tensor_cores=True, backend="fa3")
    decode.plan(page_indptr, ids, last, kv_heads * group, kv_heads, dim, page_size, q_data_type=E4M3,
                kv_data_type=E4M3, o_data_type=torch.bfloat16)
    if per_head:
        o_decode, lse_decode = decode.run(q, cache, scales["q_scale"], scales["k_scale"], scales["v_scale"],
                                          return_lse=True)
    else:
        o_decode, lse_decode = decode.run(q, cache, return_lse=True, **scales)
    o_prefill, lse_prefill = run_fa3_fp8(q, k, v, [1] * batch, kv_lens, (kv_heads * group, kv_heads), scales,
                                         page_size, causal=False, gen=torch.Generator(device=DEVICE).manual_seed(9))
    torch.testing.assert_close(o_decode.float(), o_prefill.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse_decode, lse_prefill, atol=1e-3, rtol=1e-4)
