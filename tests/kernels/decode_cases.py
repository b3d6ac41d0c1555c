"""What the FA2 batch-decode GPU tests share (test_decode_gpu.py, test_decode_plan_gpu.py): the
modules they may build, hypothesis-drawn cases (runtime arguments only), batches on the GPU, runs
into NaN-poisoned outputs and the checks against attnforge.reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

import attnforge
from attnforge import reference

DEVICE = "cuda"
NAN = math.nan


def gpu_settings(max_examples: int):
    return settings(
        max_examples=max_examples,
        deadline=None,  # the first example of each module includes its ~20 s build
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


# ---------------------------------------------------------------------------------------
# what the tests may build


@dataclass(frozen=True)
class Module:
    """The compile-time part of a decode spec; plan() picks the module from its arguments."""

    dtype: torch.dtype  # q and o
    head_dim: int
    soft_cap: bool = False
    window: bool = False
    fp8_kv: torch.dtype | None = None  # the KV cache's fp8 dtype; None: the query's dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.fp8_kv or self.dtype


MODULES = [
    Module(torch.bfloat16, 64),
    Module(torch.bfloat16, 128),
    Module(torch.bfloat16, 256),
    Module(torch.float16, 128),
    Module(torch.bfloat16, 128, window=True),
    Module(torch.bfloat16, 128, soft_cap=True),
    Module(torch.bfloat16, 256, soft_cap=True),
    Module(torch.bfloat16, 256, soft_cap=True, window=True),
]
PLAIN_MODULES = [m for m in MODULES if not (m.soft_cap or m.window)]
FP8_MODULES = [
    Module(torch.bfloat16, 128, fp8_kv=torch.float8_e4m3fn),
    Module(torch.float16, 128, fp8_kv=torch.float8_e5m2),
    Module(torch.bfloat16, 64, fp8_kv=torch.float8_e4m3fn),
    Module(torch.bfloat16, 256, fp8_kv=torch.float8_e4m3fn),
]

PAGE_SIZES = [1, 2, 5, 8, 16, 32, 64]
GROUPS = [1, 2, 3, 4, 5, 6, 7, 8, 16]
KV_HEADS = [1, 2, 4, 8]

# vs the fp32 reference fed the same 16-bit inputs: the output rounding dominates
O_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}
LSE_TOL = dict(atol=1e-2, rtol=1e-3)
# relative L2 error of o vs the reference on fp8-KV modules: a few times o's rounding (2^-9 bf16,
# 2^-12 fp16, rms), the v_scale multiply after the kernel rounding once more
FP8_REL_L2_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def same_kernel_tol(dtype):
    """Two fp32 computations that differ only in summation order, each rounded to dtype:
    at most one ulp apart in o (eps relative) and fp32 noise in lse."""
    return dict(atol=1e-4, rtol=2 * torch.finfo(dtype).eps), dict(atol=1e-4, rtol=1e-5)


def summation_order_tol(module):
    """How close two runs of `module` that differ in summation order stay: one ulp (fp32 sums),
    except that an fp8 cache with a bf16 output sums q.k and each tile's P.V in half2 (~2^-11
    relative, under bf16's rounding), which only the reference tolerances cover."""
    if module.fp8_kv is not None and module.dtype == torch.bfloat16:
        return O_TOL[module.dtype], LSE_TOL
    return same_kernel_tol(module.dtype)


# ---------------------------------------------------------------------------------------
# drawn cases


@dataclass
class Case:
    module: Module
    layout: str
    single_tensor: bool
    page_size: int
    kv_lens: list[int]
    num_kv_heads: int
    group: int
    window_left: int = -1
    soft_cap: float | None = None
    spare_pages: int = 0
    seed: int = 0
    k_scale: float | None = None  # run()'s calibration scales (fp8 modules only)
    v_scale: float | None = None

    @property
    def num_qo_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def pages_per_request(self) -> list[int]:
        return [math.ceil(n / self.page_size) for n in self.kv_lens]

    def describe(self) -> str:
        lens = self.kv_lens if len(self.kv_lens) <= 16 else f"{self.kv_lens[:16]}... ({len(self.kv_lens)} requests)"
        return (
            f"{self.module} layout={self.layout} single_tensor={self.single_tensor} page_size={self.page_size} "
            f"Hq={self.num_qo_heads} Hkv={self.num_kv_heads} window_left={self.window_left} "
            f"soft_cap={self.soft_cap} k_scale={self.k_scale} v_scale={self.v_scale} kv_lens={lens} "
            f"total={sum(self.kv_lens)}"
        )


def token_budget(module: Module, num_kv_heads: int, max_tokens: int) -> int:
    """At most max_tokens KV tokens and ~8 GB of K+V per example (of its fp32 dequantized copy
    for an fp8 cache: that is what the reference holds)."""
    element_bytes = 4 if module.fp8_kv else 2
    bytes_per_token = 2 * num_kv_heads * module.head_dim * element_bytes
    return min(max_tokens, (8 << 30) // bytes_per_token)


@st.composite
def kv_lengths(draw, batch: int, budget: int, allow_empty: bool = True) -> list[int]:
    """Ragged lengths, mostly short, sometimes up to 16k; the total stays within budget."""
    regime = draw(st.sampled_from(["short", "short", "short", "medium", "long"]))
    hi = {"short": 300, "medium": 4096, "long": 16384}[regime]
    hi = max(1, min(hi, budget // batch))
    lens = draw(st.lists(st.integers(1, hi), min_size=batch, max_size=batch))
    if allow_empty and draw(st.integers(0, 3)) == 0:  # a quarter of the batches hold empty requests
        for i in draw(st.sets(st.integers(0, batch - 1), max_size=max(1, batch // 4))):
            lens[i] = 0
    return lens


@st.composite
def cases(draw, modules=MODULES, max_batch=256, max_tokens=2_000_000, groups=GROUPS, allow_empty=True):
    module = draw(st.sampled_from(modules))
    num_kv_heads = draw(st.sampled_from(KV_HEADS))
    batch = draw(st.one_of(st.integers(1, 8), st.integers(1, min(64, max_batch)), st.integers(1, max_batch)))
    lens = draw(kv_lengths(batch, token_budget(module, num_kv_heads, max_tokens), allow_empty))
    window_left = draw(st.one_of(st.integers(0, 64), st.integers(0, 20000))) if module.window else -1
    scales = st.one_of(st.none(), st.floats(0.5, 4.0))
    return Case(
        module=module,
        layout=draw(st.sampled_from(["NHD", "HND"])),
        single_tensor=draw(st.booleans()),
        page_size=draw(st.sampled_from(PAGE_SIZES)),
        kv_lens=lens,
        num_kv_heads=num_kv_heads,
        group=draw(st.sampled_from(groups)),
        window_left=window_left,
        soft_cap=draw(st.sampled_from([1.0, 10.0, 50.0])) if module.soft_cap else None,
        spare_pages=draw(st.integers(0, 64)),
        seed=draw(st.integers(0, 2**31 - 1)),
        k_scale=draw(scales) if module.fp8_kv else None,
        v_scale=draw(scales) if module.fp8_kv else None,
    )


# ---------------------------------------------------------------------------------------
# building a batch on the device


@dataclass
class Batch:
    q: torch.Tensor  # [B, Hq, D]
    cache: object  # (k, v) each [P, page, Hkv, D] / [P, Hkv, page, D], or one [P, 2, ...]
    indptr: torch.Tensor  # [B + 1] int32, host
    indices: torch.Tensor  # [indptr[-1]] int32, device
    last_page_len: torch.Tensor  # [B] int32, host
    num_pages: int
    extra: dict = field(default_factory=dict)


def page_table(kv_lens, page_size, num_pages, gen):
    """A random non-contiguous page table drawing from a pool of num_pages pages."""
    pages = [math.ceil(n / page_size) for n in kv_lens]
    indptr = torch.tensor([0] + list(_cumsum(pages)), dtype=torch.int32)
    indices = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32)
    # an empty request has no pages; its last_page_len is ignored, 1 keeps it in range
    last = [n - (p - 1) * page_size if p else 1 for n, p in zip(kv_lens, pages)]
    return indptr, indices.to(DEVICE), torch.tensor(last, dtype=torch.int32)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def page_shape(case: Case) -> tuple[int, ...]:
    if case.layout == "NHD":
        return (case.page_size, case.num_kv_heads, case.module.head_dim)
    return (case.num_kv_heads, case.page_size, case.module.head_dim)


def alloc_cache(case: Case, num_pages: int, gen):
    """randn pages in the module's kv dtype (an fp8 cache: fp32 randn rounded to fp8, which also
    yields fp8 subnormals, |x| < 2^-6 for e4m3)."""
    module = case.module

    def pages(shape):
        x = torch.randn(shape, dtype=module.dtype if module.fp8_kv is None else torch.float32, device=DEVICE,
                        generator=gen)
        return x.to(module.kv_dtype)

    if case.single_tensor:
        return pages((num_pages, 2, *page_shape(case)))
    return tuple(pages((num_pages, *page_shape(case))) for _ in "kv")


def make_batch(case: Case) -> Batch:
    cpu_gen = torch.Generator().manual_seed(case.seed)
    gpu_gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    num_pages = sum(case.pages_per_request) + case.spare_pages
    indptr, indices, last = page_table(case.kv_lens, case.page_size, max(num_pages, 1), cpu_gen)
    q = torch.randn(len(case.kv_lens), case.num_qo_heads, case.module.head_dim,
                    dtype=case.module.dtype, device=DEVICE, generator=gpu_gen)
    cache = alloc_cache(case, max(num_pages, 1), gpu_gen)
    return Batch(q, cache, indptr, indices, last, max(num_pages, 1))


def k_and_v(cache):
    return (cache[:, 0], cache[:, 1]) if isinstance(cache, torch.Tensor) else cache


# ---------------------------------------------------------------------------------------
# running and checking


def workspace_for(case: Case, extra_bytes: int = 0) -> torch.Tensor:
    size = attnforge.decode_workspace_size(
        len(case.kv_lens), case.num_qo_heads, case.num_kv_heads, case.module.head_dim, device=torch.device(DEVICE)
    )
    return torch.empty(size + extra_bytes, dtype=torch.uint8, device=DEVICE)


def plan(wrapper, case: Case, b: Batch, **plan_kw):
    wrapper.plan(
        b.indptr, b.indices, b.last_page_len,
        case.num_qo_heads, case.num_kv_heads, case.module.head_dim, case.page_size,
        window_left=case.window_left, logits_soft_cap=case.soft_cap,
        q_data_type=case.module.dtype, kv_data_type=case.module.kv_dtype, **plan_kw,
    )


def run_poisoned(wrapper, b: Batch, cache=None, k_scale=None, v_scale=None):
    """run() into NaN-filled out/lse buffers; returns them after checking run() used them."""
    out = torch.full(b.q.shape, NAN, dtype=b.q.dtype, device=DEVICE)
    lse = torch.full(b.q.shape[:2], NAN, dtype=torch.float32, device=DEVICE)
    o_ret, lse_ret = wrapper.run(b.q, b.cache if cache is None else cache, out=out, lse=lse, return_lse=True,
                                 k_scale=k_scale, v_scale=v_scale)
    assert o_ret.data_ptr() == out.data_ptr() and lse_ret.data_ptr() == lse.data_ptr(), "run() ignored out=/lse="
    return out, lse


def decode(case: Case, b: Batch, cache=None, workspace=None, **plan_kw):
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(
        workspace if workspace is not None else workspace_for(case), kv_layout=case.layout
    )
    plan(wrapper, case, b, **plan_kw)
    return run_poisoned(wrapper, b, cache, case.k_scale, case.v_scale)


def dequantized(case: Case, cache):
    """An fp8 cache as the fp32 values it stands for (fp8 value * scale); a 16-bit cache as is."""
    if case.module.fp8_kv is None:
        return cache
    k_scale, v_scale = case.k_scale or 1.0, case.v_scale or 1.0
    if isinstance(cache, torch.Tensor):
        return torch.stack((cache[:, 0].float() * k_scale, cache[:, 1].float() * v_scale), dim=1)
    return cache[0].float() * k_scale, cache[1].float() * v_scale


def reference_of(case: Case, b: Batch, q=None):
    return reference.batch_decode_paged(
        b.q if q is None else q, dequantized(case, b.cache), b.indptr, b.indices, b.last_page_len,
        kv_layout=case.layout, window_left=case.window_left, logits_soft_cap=case.soft_cap,
    )


def check_against_reference(case: Case, b: Batch, o, lse, q=None):
    o_ref, lse_ref = reference_of(case, b, q)
    empty = torch.tensor([n == 0 for n in case.kv_lens], device=DEVICE)
    assert not o.isnan().any(), f"NaN in o for requests {o.isnan().flatten(1).any(1).nonzero().flatten().tolist()}"
    assert not lse.isnan().any(), "NaN in lse"
    if empty.any():
        assert (o[empty] == 0).all(), "an empty request must give o = 0"
        assert (lse[empty] == -math.inf).all(), "an empty request must give lse = -inf"
    torch.testing.assert_close(o.float(), o_ref, **o_tol(case))
    torch.testing.assert_close(lse, lse_ref, **LSE_TOL)
    return o_ref


def o_tol(case: Case) -> dict:
    """O_TOL for o as the kernel writes it; a v_scale multiplies o after the kernel, and with it
    every absolute error (near-zero outputs are sums of cancelling terms of v's size)."""
    tol = O_TOL[case.module.dtype]
    return dict(tol, atol=tol["atol"] * (case.v_scale or 1.0))


def error_stats(o: torch.Tensor, o_ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max abs) error of o against the fp32 reference."""
    diff = o.float() - o_ref
    return (diff.norm() / o_ref.norm().clamp_min(1e-30)).item(), diff.abs().max().item()
