"""What the small GPU launches share (tests/kernels/test_small_launches_gpu.py and the tests that reuse
its cache and checks): a paged cache written through append_paged_kv_cache into NaN-filled pages,
NaN-poisoned outputs, and the comparison against the fp32 reference with dtype-fitting tolerances.
Imported by name (pytest's `pythonpath` holds tests/kernels)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnforge import page

DEVICE = "cuda"
WORKSPACE = 128 << 20
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALES = dict(k_scale=0.5, v_scale=1.5)
# relative L2 error of o against the fp32 reference: bf16 rounding, or fp8 (e4m3 P in fa3, the
# cache's own rounding is in the reference's input)
REL_L2_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, E4M3: 4e-2, E5M2: 4e-2}


@dataclass
class Paged:
    cache: tuple[torch.Tensor, torch.Tensor]  # NHD pages; rows no request owns hold NaN
    indptr: torch.Tensor
    ids: torch.Tensor
    last: torch.Tensor
    page_size: int


def randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, generator=gen)


def paged_cache(k: torch.Tensor, v: torch.Tensor, kv_lens: list[int], page_size: int, dtype: torch.dtype,
                gen: torch.Generator) -> Paged:
    """k, v [total_kv, heads, dim] (fp32) written through append_paged_kv_cache into shuffled pages of
    NaN-filled pools, then cast to dtype."""
    pages = [math.ceil(n / page_size) for n in kv_lens]
    pool = sum(pages) + 2
    ids = torch.randperm(pool, device=DEVICE, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32, device=DEVICE)
    # V pages take K's shape, viewed down to V's head dim: the kernels share one page stride
    pools = [torch.full((pool, page_size, *k.shape[1:]), math.nan, device=DEVICE) for _ in range(2)]
    dims = (k.shape[-1], v.shape[-1])
    kv_indptr = indptr_of(kv_lens).to(DEVICE)
    seq_lens = page.get_seq_lens(indptr, last, page_size)
    batch, positions = page.get_batch_indices_positions(kv_indptr, seq_lens, k.shape[0])
    page.append_paged_kv_cache(k, v, batch, positions, (pools[0], pools[1][..., : dims[1]]), ids, indptr, last)
    return Paged(tuple(x.to(dtype)[..., :d] for x, d in zip(pools, dims)), indptr, ids, last, page_size)


def indptr_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def dequantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.float() * scale


def assert_close(out: torch.Tensor, lse: torch.Tensor, o_ref: torch.Tensor, lse_ref: torch.Tensor,
                 dtype: torch.dtype) -> None:
    assert not out.isnan().any() and not lse.isnan().any(), "rows left unwritten (NaN)"
    diff = (out.float() - o_ref.float()).norm() / o_ref.float().norm()
    assert diff <= REL_L2_TOL[dtype], f"relative L2 error {diff:.3g} > {REL_L2_TOL[dtype]}"
    torch.testing.assert_close(lse, lse_ref.float(), atol=2e-2, rtol=1e-3)


def poisoned(shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full(shape, math.nan, dtype=dtype, device=DEVICE),
            torch.full(shape[:2], math.nan, dtype=torch.float32, device=DEVICE))
