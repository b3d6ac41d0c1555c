"""Attention sinks without a GPU: the sinks pointer in the C ABI (rendered struct, ctypes mirror,
split-KV merge arguments), and the reference's sink semantics (gpt-oss / FlashInfer run(sinks=)):
one natural-log logit per query head, an extra key with no value, counted in the base-2 lse."""

from __future__ import annotations

import math
import re

import pytest
import torch

from attnforge import reference
from attnforge.codegen.abi import DECODE_PARAMS, PREFILL_PARAMS
from attnforge.codegen.dtypes import DType
from attnforge.codegen.render import render
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind


def _spec(kind: Kind, backend: Backend, arch: Arch) -> KernelSpec:
    return KernelSpec(kind=kind, backend=backend, dtype_q=DType.BF16, dtype_kv=DType.BF16, dtype_o=DType.BF16,
                      head_dim_qk=128, head_dim_vo=128, archs=(arch,))


@pytest.mark.parametrize("struct", [DECODE_PARAMS, PREFILL_PARAMS], ids=lambda s: s.name)
def test_params_carry_a_sinks_pointer(struct):
    assert {f.name: f for f in struct.fields}["sinks"].ctype == "const void*"


@pytest.mark.parametrize("kind, backend, arch", [(Kind.DECODE, Backend.FA2, Arch.SM80),
                                                 (Kind.PREFILL, Backend.FA2, Arch.SM80),
                                                 (Kind.PREFILL, Backend.FA3, Arch.SM90A)])
def test_rendered_module_declares_mirrors_and_merges_with_sinks(kind, backend, arch):
    files = render(_spec(kind, backend, arch)).files
    params = "DecodeParams" if kind is Kind.DECODE else "PrefillParams"
    assert re.search(rf"struct {params} \{{[^}}]*const void\* sinks;", files["config.cuh"])
    assert '("sinks", ctypes.c_void_p)' in files["binding.py"]
    # the split-KV merge joins the sink of the rows it merges (the attention kernel, of the rows it writes);
    # decode merges inside its kernel (fa2/decode_kernel.cuh merge_if_last), prefill in the merge kernel
    if kind is Kind.PREFILL:
        assert "static_cast<const float*>(params->sinks)};" in files["entry.cu"]


def _single(sinks=None, **kwargs):
    q = torch.tensor([[1.0]])  # [Hq=1, D=1]
    k = torch.tensor([[[1.0]], [[2.0]]])  # [kv_len=2, Hkv=1, D=1]: scores 1 and 2 at sm_scale 1
    v = torch.tensor([[[1.0]], [[3.0]]])
    return reference.single_decode(q, k, v, sm_scale=1.0, sinks=sinks, **kwargs)


def test_reference_sink_by_hand():
    o, lse = _single(torch.tensor([0.5]))
    denominator = math.exp(0.5) + math.exp(1.0) + math.exp(2.0)
    assert o.item() == pytest.approx((math.exp(1.0) * 1 + math.exp(2.0) * 3) / denominator, rel=1e-6)
    assert lse.item() == pytest.approx(math.log2(denominator), rel=1e-6)
    # a window that leaves one key: the sink competes with it alone
    o, lse = _single(torch.tensor([0.5]), window_left=0)
    assert o.item() == pytest.approx(3 * math.exp(2.0) / (math.exp(0.5) + math.exp(2.0)), rel=1e-6)
    assert lse.item() == pytest.approx(math.log2(math.exp(0.5) + math.exp(2.0)), rel=1e-6)


def test_reference_sink_of_minus_inf_is_no_sink_and_a_huge_one_zeroes_o():
    torch.manual_seed(0)
    q, paged = torch.randn(3, 4, 16), (torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16))
    indptr, indices, last = torch.tensor([0, 1, 3, 6]), torch.tensor([5, 0, 2, 1, 3, 4]), torch.tensor([2, 4, 1])
    o, lse = reference.batch_decode_paged(q, paged, indptr, indices, last)
    o_inf, lse_inf = reference.batch_decode_paged(q, paged, indptr, indices, last, sinks=torch.full((4,), -math.inf))
    assert torch.equal(o, o_inf) and torch.equal(lse, lse_inf)
    o_big, lse_big = reference.batch_decode_paged(q, paged, indptr, indices, last, sinks=torch.full((4,), 80.0))
    assert o_big.abs().max() < 1e-20
    assert torch.allclose(lse_big, torch.full_like(lse_big, 80.0 / math.log(2)))


def test_reference_sinks_per_head_in_prefill_and_a_row_without_keys():
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    sinks = torch.tensor([0.25, -1.0])
    # causal, qo_len 5 > kv_len 3: the first two rows see no key: o = 0, lse = the sink's (base 2)
    o, lse = reference.single_prefill(q, k, v, causal=True, sinks=sinks, o_dtype=torch.float32)
    assert torch.equal(o[:2], torch.zeros_like(o[:2]))
    assert torch.allclose(lse[:2], (sinks / math.log(2)).expand(2, 2))
    # the other rows: softmax over [scores, sink] (GQA: both heads read kv head 0), the sink column dropped
    s = torch.einsum("thd,ld->htl", q[2:], k[:, 0]) / math.sqrt(8)
    s = s.masked_fill(torch.arange(3)[None, None, :] > torch.arange(1, 4)[None, :, None] - 1, -math.inf)
    full = torch.cat([s, sinks[:, None, None].expand(2, 3, 1)], dim=-1)
    expected = torch.einsum("htl,ld->thd", full.softmax(-1)[..., :3], v[:, 0])
    assert torch.allclose(o[2:], expected, atol=1e-6)
    assert torch.allclose(lse[2:], (torch.logsumexp(full, -1) / math.log(2)).T, atol=1e-6)
    ragged_o, ragged_lse = reference.batch_prefill_ragged(q, k, v, torch.tensor([0, 5]), torch.tensor([0, 3]),
                                                          causal=True, sinks=sinks, o_dtype=torch.float32)
    assert torch.equal(ragged_o, o) and torch.equal(ragged_lse, lse)


def test_reference_refuses_sinks_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"sinks: expected a float tensor of shape \(1,\)"):
        _single(torch.zeros(2))
