"""What the batch-decode wrapper's plan() was given, in FlashInfer's terms, and its checked form.

    resolve_data_type  FlashInfer's deprecated data_type: fills only the dtypes left None
    refuse_extras      plan() arguments FlashInfer has for features attnforge does not (yet) have
    check_q_len        q_len_per_req and is_causal, FlashInfer's multi-token decode arguments
    check_kv_covers_queries  multi-token decode: every request's KV holds its query tokens
    DecodePlanInputs   plan()'s arguments as given: what fast_decode_plan and forward() plan again from
    DecodeKnobs        the checked, page-table-independent part: the module and scalars, reusable
                       by a re-plan whose only change is the page table (lengths)

Nothing here touches the GPU: these are the CPU-testable front of plan().
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import PosEncoding

from . import checks, dispatch, kv_cache


def resolve_data_type(q_data_type, kv_data_type, data_type):
    """(q, kv) dtypes after FlashInfer's rule: data_type (deprecated) fills only those left None,
    and a query dtype still None is float16."""
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    return ("float16" if q_data_type is None else q_data_type), kv_data_type


def refuse_extras(*, block_tables, seq_lens, window_right, use_token_head_sf) -> None:
    """FlashInfer plan() arguments accepted at their neutral values and refused otherwise, naming them."""
    if block_tables is not None or seq_lens is not None:
        raise ValueError("block_tables/seq_lens: pass the page table as indptr, indices and last_page_len")
    if window_right != 0:
        raise ValueError(f"window_right: only 0 (no key after the query token) is supported, got {window_right!r}")
    if use_token_head_sf:
        raise ValueError("use_token_head_sf: per-(token, head) fp8 KV scales are not supported; pass per-tensor "
                         "k_scale/v_scale to run()")


def check_q_len(q_len_per_req, is_causal, tensor_cores: bool) -> int:
    """FlashInfer's multi-token decode (speculative verification): each request has q_len_per_req
    query tokens, causal among them, on the tensor-core path only; is_causal follows from it and may
    only be given at that value."""
    checks.positive_int(q_len_per_req, "q_len_per_req", why="query tokens per request; int32 in the plan")
    if is_causal is not None and bool(is_causal) != (q_len_per_req > 1):
        raise ValueError(f"is_causal={is_causal!r}: decode is causal exactly when q_len_per_req > 1 (here "
                         f"{q_len_per_req}); leave it None")
    if q_len_per_req > 1 and not tensor_cores:
        raise ValueError(f"q_len_per_req={q_len_per_req}: several query tokens per request run on the tensor-core "
                         "decode path; construct the wrapper with use_tensor_cores=True")
    return q_len_per_req


def check_kv_covers_queries(indptr: torch.Tensor, last_page_len, page_size: int, q_len: int) -> None:
    """Multi-token decode: the q_len verified tokens are the last q_len keys of each request, so every
    request holds at least that many (FlashInfer's rule). indptr: the checked host int32 indptr."""
    last = checks.host_int32(last_page_len, "last_page_len", indptr.numel() - 1)
    kv_lens = kv_cache.kv_lengths(indptr, last, page_size)
    short = int(kv_lens.argmin())
    if int(kv_lens[short]) < q_len:
        raise ValueError(f"q_len_per_req={q_len}: request {short} has {int(kv_lens[short])} KV tokens; each request's "
                         "KV must include its q_len_per_req query tokens")


def refuse_run_extras(skip_softmax_threshold_scale_factor, kv_cache_sf) -> None:
    """FlashInfer run() arguments for features attnforge does not have, named when given."""
    if skip_softmax_threshold_scale_factor is not None:
        raise ValueError("skip_softmax_threshold_scale_factor: skip-softmax decode is not supported; leave it None")
    if kv_cache_sf is not None:
        raise ValueError("kv_cache_sf: per-(token, head) KV scale factors are not supported; leave it None")


@dataclass(slots=True)
class DecodePlanInputs:
    """plan()'s arguments as given, the dtypes after resolve_data_type."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pos_encoding_mode: str
    window_left: int
    logits_soft_cap: float | None
    q_data_type: object
    kv_data_type: object
    o_data_type: object
    sm_scale: float | None
    rope_scale: float | None
    rope_theta: float | None
    fixed_split_size: int | None
    disable_split_kv: bool
    q_len_per_req: int = 1  # query tokens per request (checked by check_q_len)

    def knobs_key(self) -> tuple:
        """Everything but the page table: equal keys plan the same module and scalars."""
        return (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, self.pos_encoding_mode,
                self.window_left, self.logits_soft_cap, self.q_data_type, self.kv_data_type, self.o_data_type,
                self.sm_scale, self.rope_scale, self.rope_theta, self.fixed_split_size, self.disable_split_kv,
                self.q_len_per_req)


@dataclass(slots=True)
class DecodeKnobs:
    """DecodePlanInputs' page-table-independent part, checked."""

    key: tuple  # the DecodePlanInputs.knobs_key() it was checked from
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pos_encoding: PosEncoding
    window_left: int
    soft_cap: float
    sm_scale: float
    rope_scale: float  # RoPE: positions are divided by it
    rope_theta: float  # RoPE: the frequencies' base
    dtype_q: DType
    dtype_kv: DType
    dtype_o: DType
    fixed_split_size: int | None
    disable_split_kv: bool


def check_knobs(inputs: DecodePlanInputs) -> DecodeKnobs:
    num_qo_heads, num_kv_heads = checks.heads(inputs.num_qo_heads, inputs.num_kv_heads)
    head_dim = checks.positive_int(inputs.head_dim, "head_dim")
    page_size = checks.positive_int(inputs.page_size, "page_size")
    checks.split_size(inputs.fixed_split_size, page_size)
    dtype_q, dtype_kv, dtype_o = dispatch.planned_dtypes(inputs.q_data_type, inputs.kv_data_type, inputs.o_data_type)
    return DecodeKnobs(
        key=inputs.knobs_key(), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, pos_encoding=dispatch.parse_pos_encoding(inputs.pos_encoding_mode),
        window_left=checks.window_left(inputs.window_left),
        soft_cap=checks.soft_cap(inputs.logits_soft_cap),
        sm_scale=checks.positive_float(inputs.sm_scale, "sm_scale", 1.0 / math.sqrt(head_dim)),
        rope_scale=checks.positive_float(inputs.rope_scale, "rope_scale", 1.0),
        rope_theta=checks.positive_float(inputs.rope_theta, "rope_theta", 1e4),
        dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_o, fixed_split_size=inputs.fixed_split_size,
        disable_split_kv=bool(inputs.disable_split_kv))
