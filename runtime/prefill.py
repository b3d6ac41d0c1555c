"""Batch prefill over a paged or ragged KV cache: FlashInfer's BatchPrefillWithPagedKVCacheWrapper
and BatchPrefillWithRaggedKVCacheWrapper, and single_prefill_with_kv_cache.

plan() validates the index arrays on the host, derives the kernel spec (building the module on
first use), schedules (request, q tile, kv chunk) work items through the module's C++ planner and
uploads the plan with one asynchronous copy. run() checks tensor metadata, patches pointers into
the parameter struct and launches on the caller's current stream without waiting for the GPU.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from attnforge.codegen.abi import PLAN_ERROR_BAD_PAGE, PLAN_HEADER
from attnforge.codegen.dtypes import DType
from attnforge.codegen.render import fa3_cta_tile
from attnforge.codegen.spec import Backend, PosEncoding

from . import checks, dispatch, kv_cache
from .loader import Module, load
from .mask import segment_packbits
from .plan_buffers import (
    PlanImage,
    cuda_index,
    current_stream,
    float_workspace,
    lse_output,
    num_sms,
    output,
    score_scales,
    split_tokens,
)
from .planner import MIN_CHUNK_TOKENS
from .prefill_ahead import GATHER_MAX_BYTES, VT_BLOCK_KEYS, gathered_kv_bytes, gathered_rows, gathers_pages, transposed_v_blocks
from .prefill_planner import (
    PrefillPlanLayout,
    cta_tile_q,
    packed_len_estimate,
    prefill_partial_capacity,
    prefill_work_capacity,
)
from .settings import settings



@functools.cache
def _prefill_module(backend: str, dtype_q: DType, dtype_kv: DType, dtype_o: DType, head_dim_qk: int, head_dim_vo: int,
                    pos_encoding: PosEncoding, use_sliding_window: bool, use_logits_soft_cap: bool,
                    use_custom_mask: bool, device_index: int) -> Module:
    spec = dispatch.prefill_spec(
        backend=backend, dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_o, head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo, pos_encoding=pos_encoding, use_sliding_window=use_sliding_window,
        use_logits_soft_cap=use_logits_soft_cap, use_custom_mask=use_custom_mask,
        archs=dispatch.device_archs(device_index))
    return load(spec)


@functools.cache
def _max_ctas(module: Module, tile: int, paged: bool, device_index: int) -> int:
    ctas_per_sm = ctypes.c_int32()
    module.check(module.fns["prefill_occupancy"](tile, int(paged), device_index, ctypes.byref(ctas_per_sm)),
                 "prefill occupancy query")
    return num_sms(device_index) * max(ctas_per_sm.value, 1)


@dataclass
class _Plan:
    """What run() needs from plan()."""

    module: Module
    params: ctypes.Structure
    total_q: int
    total_kv: int  # ragged: kv_indptr[-1]
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    dtype_q: torch.dtype
    dtype_kv: torch.dtype
    dtype_o: torch.dtype
    sm_scale: float
    soft_cap: float
    window_left: int
    host_max_page: int | None
    keep_alive: tuple  # device tensors the kernel reads (page ids, packed mask)


def one_token_requests(qo_indptr: torch.Tensor) -> bool:
    """Whether no request of the (host) qo_indptr has more than one query token."""
    return bool((qo_indptr[1:] - qo_indptr[:-1]).max() <= 1)


# Offsets of image arrays only run() reads (the planner neither writes nor knows them).
_RUN_ONLY_OFFSETS = ("off_mask_indptr", "off_gathered_kv_indptr", "off_vt_block")


class _BatchPrefillWrapper:
    """plan()/run() machinery shared by the paged and ragged wrappers."""

    _paged: bool

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool, backend: str,
                 jit_args, jit_kwargs) -> None:
        self._workspace = float_workspace(float_workspace_buffer)
        self._device = float_workspace_buffer.device
        self._kv_layout = kv_cache.check_layout(kv_layout)
        if jit_args is not None or jit_kwargs is not None:
            raise ValueError("jit_args/jit_kwargs: custom attention variants are not supported; leave them None")
        self._backend = dispatch.parse_backend(backend)
        self._graph = bool(use_cuda_graph)
        self._graph_shape: tuple[int, int] | None = None  # (batch, rows) the first graph plan fixed
        self._image = PlanImage(self._device, fixed_address=self._graph)
        self._plan: _Plan | None = None
        self._debug = settings().debug
        # Set by the tensor-core decode wrapper, whose plans have one query token per request: a
        # CUDA-graph replay keeps the kernel it captured, so only such a wrapper may promise it.
        self._decode_plans = False

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph

    # ------------------------------------------------------------------ plan
    def _plan_batch(self, *, qo_indptr, kv_indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
                    head_dim_qk: int, head_dim_vo: int | None, page_size: int, custom_mask, packed_custom_mask,
                    causal: bool, pos_encoding_mode, use_fp16_qk_reduction: bool, sm_scale, window_left: int,
                    logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type,
                    fixed_split_size, disable_split_kv: bool) -> None:
        qo_indptr = checks.host_int32(qo_indptr, "qo_indptr")
        batch_size = qo_indptr.numel() - 1
        if batch_size < 1:
            raise ValueError(f"qo_indptr: expected at least 2 entries (batch_size + 1), got {qo_indptr.numel()}")
        kv_name = "paged_kv_indptr" if self._paged else "kv_indptr"
        kv_indptr = checks.host_int32(kv_indptr, kv_name, batch_size + 1)
        if self._paged:
            kv_cache.check_page_ids(indices, "paged_kv_indices")
        num_qo_heads, num_kv_heads = checks.heads(num_qo_heads, num_kv_heads)
        head_dim_qk = checks.positive_int(head_dim_qk, "head_dim_qk")
        head_dim_vo = head_dim_qk if head_dim_vo is None else checks.positive_int(head_dim_vo, "head_dim_vo")
        page_size = checks.positive_int(page_size, "page_size")
        window_left = checks.window_left(window_left)
        soft_cap = checks.soft_cap(logits_soft_cap)
        sm_scale = checks.positive_float(sm_scale, "sm_scale", 1.0 / math.sqrt(head_dim_qk))
        rope_scale = checks.positive_float(rope_scale, "rope_scale", 1.0)
        rope_theta = checks.positive_float(rope_theta, "rope_theta", 1e4)
        checks.split_size(fixed_split_size)
        if custom_mask is not None and packed_custom_mask is not None:
            raise ValueError("custom_mask, packed_custom_mask: pass one of them, not both")
        use_custom_mask = custom_mask is not None or packed_custom_mask is not None
        if use_custom_mask and causal:
            raise ValueError("causal=True with a custom mask: the custom mask replaces the causal mask; pass "
                             "causal=False (and put the causal pattern into the mask if you want it)")

        if use_fp16_qk_reduction:
            raise ValueError("use_fp16_qk_reduction: the prefill kernels accumulate q.k in fp32; pass False")
        dtype_q, dtype_kv, dtype_o = dispatch.planned_dtypes(q_data_type, kv_data_type, o_data_type)
        device_index = cuda_index(self._device)
        module = _prefill_module(self._backend, dtype_q, dtype_kv, dtype_o, head_dim_qk, head_dim_vo,
                                 dispatch.parse_pos_encoding(pos_encoding_mode), window_left >= 0, soft_cap > 0,
                                 use_custom_mask, device_index)

        keep_alive = []
        host_max_page = None
        if self._paged:
            indices, host_max_page = kv_cache.stage_page_ids(indices, int(kv_indptr[-1]), self._device,
                                                             "paged_kv_indices", self._graph_indices,
                                                             "paged_kv_indices_buf")
            keep_alive.append(indices)
            last_page_len = checks.host_int32(last_page_len, "paged_kv_last_page_len", batch_size)
        group = num_qo_heads // num_kv_heads
        total_q = int(qo_indptr[-1])
        if self._graph:
            if self._graph_shape is None:
                self._graph_shape = (batch_size, total_q)
            elif batch_size != self._graph_shape[0] or total_q > self._graph_shape[1]:
                raise ValueError(f"qo_indptr: this CUDA-graph wrapper was planned for batch_size={self._graph_shape[0]} "
                                 f"and at most {self._graph_shape[1]} query tokens, got {batch_size} and {total_q}")
        rows = self._graph_shape[1] if self._graph else total_q
        fixed_tile = fa3_cta_tile(module.spec) if module.spec.backend is Backend.FA3 else 0
        tile = fixed_tile or cta_tile_q(packed_len_estimate(rows, batch_size, group, self._graph), head_dim_qk)
        max_ctas = _max_ctas(module, tile, self._paged, device_index)
        kv_page = page_size if self._paged else 1
        fixed_tokens = split_tokens(fixed_split_size, kv_page)
        capacity = prefill_work_capacity(rows, batch_size, group, tile, max_ctas, num_kv_heads)
        if fixed_tokens and not self._graph:  # every q tile may be cut into that many chunks
            capacity = max(capacity, capacity * -(-int(kv_indptr[-1]) * kv_page // fixed_tokens))
        layout = PrefillPlanLayout(batch_size, capacity, rows)
        offsets = layout.offsets()
        # The custom mask's per-request byte offsets follow the planner's arrays.
        offsets["off_mask_indptr"] = layout.size
        image_size = layout.size + (batch_size + 1 if use_custom_mask else 0)
        # fa3 may gather its pages and (fp8) transpose V ahead, not under CUDA graphs, whose replays
        # keep the kernels they captured: each request's first gathered row and first V^T block follow.
        fa3_ahead = module.spec.backend is Backend.FA3 and not self._graph
        may_gather = fa3_ahead and self._paged
        may_transpose_v = fa3_ahead and module.spec.dtype_kv.is_fp8
        offsets["off_gathered_kv_indptr"] = image_size
        image_size += batch_size + 1 if may_gather else 0
        offsets["off_vt_block"] = image_size
        image_size += batch_size + 1 if may_transpose_v else 0
        image = self._image.host_buffer(image_size)

        binding = module.binding
        args = binding.PrefillPlanArgs(
            qo_indptr=qo_indptr.data_ptr(), kv_indptr=kv_indptr.data_ptr(),
            last_page_len=last_page_len.data_ptr() if self._paged else None, image=image.data_ptr(),
            batch_size=batch_size, paged=int(self._paged), page_size=kv_page,
            num_indices=indices.numel() if self._paged else int(kv_indptr[-1]), num_kv_heads=num_kv_heads,
            group_size=group, head_dim_qk=head_dim_qk, fixed_cta_tile_q=fixed_tile, max_ctas=max_ctas,
            causal=int(bool(causal)),
            window_left=window_left, fixed_split_tokens=fixed_tokens, disable_split_kv=int(bool(disable_split_kv)),
            min_chunk_tokens=MIN_CHUNK_TOKENS, cuda_graph=int(self._graph), work_capacity=capacity,
            row_capacity=rows,
            **{name: value for name, value in offsets.items() if name not in _RUN_ONLY_OFFSETS})
        info = binding.PrefillPlanInfo()
        status = module.fns["prefill_plan"](ctypes.byref(args), ctypes.byref(info))
        if status != 0:
            raise ValueError(f"plan(): {module.last_error()}")
        assert info.cta_tile_q == tile, "the planner and the wrapper must pick the same q tile"

        mask = None
        if use_custom_mask:
            mask = self._stage_mask(custom_mask, packed_custom_mask, qo_indptr, image, offsets["off_kv_len"],
                                    offsets["off_mask_indptr"], batch_size)
            keep_alive.append(mask)
        slots = prefill_partial_capacity(capacity, tile, group) if self._graph else info.num_partials
        v_bytes = -(-slots * num_qo_heads * head_dim_vo * 4 // 256) * 256
        s_bytes = slots * num_qo_heads * 4
        available = self._workspace.numel() * self._workspace.element_size()
        if v_bytes + s_bytes > available:
            raise ValueError(f"float_workspace_buffer: this plan needs {v_bytes + s_bytes} bytes for split-KV partials, "
                             f"the buffer has {available}; allocate at least that many (128 MiB covers typical batches)")
        # After the partials: the gathered pages, then V^T, each where the workspace still holds it.
        ahead_offset = -(-(v_bytes + s_bytes) // 1024) * 1024
        gathered_pages = gathered_bytes = 0
        vt_first = None
        if may_gather or may_transpose_v:
            qo_lens = qo_indptr[1:] - qo_indptr[:-1]
            kv_lens = image[offsets["off_kv_len"]: offsets["off_kv_len"] + batch_size]
        if may_gather and gathers_pages(qo_lens, kv_lens, group, causal, window_left):
            gathered_pages = int(kv_indptr[-1]) - int(kv_indptr[0])
            gathered_bytes = gathered_kv_bytes(gathered_pages * page_size, num_kv_heads, head_dim_qk + head_dim_vo,
                                               dispatch.torch_dtype(dtype_kv).itemsize)
            if ahead_offset + gathered_bytes > min(available, GATHER_MAX_BYTES):
                gathered_pages, gathered_bytes = 0, 0
        if gathered_pages:
            image[offsets["off_gathered_kv_indptr"]: offsets["off_gathered_kv_indptr"] + batch_size + 1] = \
                gathered_rows(kv_indptr, page_size)
        vt_offset = ahead_offset + gathered_bytes
        if may_transpose_v:
            vt_first = transposed_v_blocks(qo_lens, kv_lens, group, tile)
        vt_blocks = int(vt_first[-1]) if vt_first is not None else 0
        if vt_offset + num_kv_heads * vt_blocks * VT_BLOCK_KEYS * head_dim_vo > available:
            vt_first, vt_blocks = None, 0
        if vt_first is not None:
            image[offsets["off_vt_block"]: offsets["off_vt_block"] + batch_size + 1] = vt_first
        self._image.upload(image_size)

        workspace_ptr = self._workspace.data_ptr()
        params = binding.PrefillParams(
            indices=indices.data_ptr() if self._paged else None, custom_mask=mask.data_ptr() if mask is not None else None,
            plan=self._image.on_device.data_ptr(), tmp_v=workspace_ptr, tmp_s=workspace_ptr + v_bytes,
            v_transposed=workspace_ptr + vt_offset if vt_first is not None else None, vt_blocks=vt_blocks,
            kv_gathered=workspace_ptr + ahead_offset if gathered_pages else None,
            gather_first_page=int(kv_indptr[0]) if gathered_pages else 0, gathered_pages=gathered_pages,
            batch_size=batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, group_size=group,
            page_size=kv_page, work_capacity=capacity if self._graph else info.num_work, max_ctas=max_ctas,
            row_capacity=rows, causal=int(bool(causal)), window_left=window_left, cta_tile_q=tile,
            paged=int(self._paged), run_merge=int(self._graph or info.num_partials > 0), device=device_index,
            one_token_requests=int(self._decode_plans if self._graph else one_token_requests(qo_indptr)),
            debug_sync=int(self._debug), rope_rcp_scale=1.0 / rope_scale, rope_rcp_theta=1.0 / rope_theta,
            **offsets)
        self._plan = _Plan(
            module=module, params=params, total_q=total_q, total_kv=int(kv_indptr[-1]), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size,
            dtype_q=dispatch.torch_dtype(dtype_q), dtype_kv=dispatch.torch_dtype(dtype_kv),
            dtype_o=dispatch.torch_dtype(dtype_o), sm_scale=float(sm_scale), soft_cap=soft_cap,
            window_left=window_left, host_max_page=host_max_page, keep_alive=tuple(keep_alive))

    def _stage_mask(self, custom_mask, packed_custom_mask, qo_indptr, image, off_kv_len: int, off_mask_indptr: int,
                    batch_size: int) -> torch.Tensor:
        """The bit-packed mask on the device, and its per-request byte offsets in the plan image."""
        qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
        kv_lens = image[off_kv_len: off_kv_len + batch_size].to(torch.int64)
        bits = qo_lens * kv_lens
        if custom_mask is not None:
            checks.tensor(custom_mask, "custom_mask")
            flat = custom_mask.reshape(-1)
            if flat.numel() != int(bits.sum()):
                raise ValueError(f"custom_mask: expected sum(qo_len * kv_len) = {int(bits.sum())} booleans, got "
                                 f"{flat.numel()}")
            bit_indptr = torch.zeros(batch_size + 1, dtype=torch.int64)
            torch.cumsum(bits, 0, out=bit_indptr[1:])
            packed, byte_indptr = segment_packbits(flat.to(torch.bool), bit_indptr.to(flat.device), bitorder="little")
            byte_indptr = byte_indptr.cpu()
        else:
            checks.tensor(packed_custom_mask, "packed_custom_mask")
            checks.dtype(packed_custom_mask, "packed_custom_mask", torch.uint8)
            byte_indptr = torch.zeros(batch_size + 1, dtype=torch.int64)
            torch.cumsum((bits + 7) // 8, 0, out=byte_indptr[1:])
            if packed_custom_mask.numel() != int(byte_indptr[-1]):
                raise ValueError(f"packed_custom_mask: expected {int(byte_indptr[-1])} bytes (each request's "
                                 f"qo_len * kv_len bits padded to whole bytes), got {packed_custom_mask.numel()}")
            packed = packed_custom_mask
        image[off_mask_indptr: off_mask_indptr + batch_size + 1] = byte_indptr.to(torch.int32)
        return packed.to(self._device, non_blocking=True).contiguous()

    # ------------------------------------------------------------------ run
    def _launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_strides: tuple, v_strides: tuple,
                num_pages: int, args: tuple, q_scale, k_scale, v_scale, out, lse, return_lse: bool) -> object:
        plan = self._plan
        fp8_query = dispatch.to_dtype(plan.dtype_q, "q_data_type").is_fp8
        q_scale, k_scale, v_scale = checks.positional_scales(args, fp8_query, q_scale, k_scale, v_scale)
        checks.tensor(q, "q")
        checks.dtype(q, "q", plan.dtype_q, "q_data_type given to plan()")
        checks.device(q, "q", self._device)
        checks.shape(q, "q", (plan.total_q, plan.num_qo_heads, plan.head_dim_qk),
                     "[qo_indptr[-1], num_qo_heads, head_dim_qk]")
        checks.vector_aligned(q, "q")
        out = output(out, "out", (plan.total_q, plan.num_qo_heads, plan.head_dim_vo), plan.dtype_o, self._device,
                     "[qo_indptr[-1], num_qo_heads, head_dim_vo]")
        if return_lse:
            lse = lse_output(lse, (plan.total_q, plan.num_qo_heads), self._device, "[qo_indptr[-1], num_qo_heads]")
        params = plan.params
        q_scale, k_scale, v_scale = self._scales(fp8_query, q_scale, k_scale, v_scale)
        params.sm_scale_log2, params.soft_cap_log2 = score_scales(plan.sm_scale * (q_scale or 1.0) * (k_scale or 1.0),
                                                                  plan.soft_cap)
        params.q, params.k, params.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        params.o, params.lse = out.data_ptr(), lse.data_ptr() if return_lse else None
        params.q_stride_n, params.q_stride_h = q.stride(0), q.stride(1)
        params.o_stride_n, params.o_stride_h = out.stride(0), out.stride(1)
        params.kv_stride_page, params.kv_stride_token, params.kv_stride_head = k_strides
        params.v_stride_page, params.v_stride_token, params.v_stride_head = v_strides
        params.num_pages = num_pages
        params.q_tokens = q.shape[0]
        stream = current_stream(cuda_index(self._device))
        plan.module.check(plan.module.fns["prefill_run"](ctypes.byref(params), stream), "prefill run")
        if params.debug_sync and self._image.read_slot(PLAN_HEADER.index("error")) & PLAN_ERROR_BAD_PAGE:
            raise RuntimeError(f"{plan.module.spec.uri}: {plan.module.spec.backend.value}::prefill_kernel read a page id "
                               f"outside [0, {num_pages}) from paged_kv_indices; the affected outputs are NaN")
        if v_scale is not None and v_scale != 1.0:
            out.mul_(v_scale)
        return (out, lse) if return_lse else out

    def _scales(self, fp8_query: bool, q_scale, k_scale, v_scale) -> tuple[float | None, float | None, float | None]:
        """The float scales; tensor (per-head) ones, which only the fa3 fp8 kernels take, go into the
        params for the kernel to read (a float q/k scale folds into sm_scale, a float v_scale
        multiplies o afterwards)."""
        plan, params = self._plan, self._plan.params
        if not fp8_query:
            return checks.scale(q_scale, "q_scale"), checks.scale(k_scale, "k_scale"), checks.scale(v_scale, "v_scale")
        floats = []
        for name, value, heads in (("q_scale", q_scale, plan.num_qo_heads), ("k_scale", k_scale, plan.num_kv_heads),
                                   ("v_scale", v_scale, plan.num_kv_heads)):
            tensor, number = checks.head_scale(value, name, heads, self._device)
            setattr(params, name, None if tensor is None else tensor.data_ptr())
            setattr(params, f"{name}_stride", 0 if tensor is None or tensor.numel() == 1 else 1)
            floats.append(number)
        return tuple(floats)

    def _require_plan(self) -> _Plan:
        if self._plan is None:
            raise RuntimeError("run() called before plan(): call plan() with the batch's indptr arrays first")
        return self._plan

    def end_forward(self) -> None:
        """FlashInfer compatibility: nothing to release."""


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillWrapper):
    """Prefill (or append, or speculative verify) attention of ragged queries over a paged KV cache,
    with FlashInfer's constructor, plan() and run() arguments. LSE is base 2."""

    _paged = True

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs)
        self._graph_indices = None
        if self._graph:
            if paged_kv_indices_buf is None:
                raise ValueError("paged_kv_indices_buf: use_cuda_graph=True needs a preallocated int32 CUDA buffer for "
                                 "the page ids, so the captured kernels read a fixed address")
            checks.tensor(paged_kv_indices_buf, "paged_kv_indices_buf")
            checks.dtype(paged_kv_indices_buf, "paged_kv_indices_buf", torch.int32)
            checks.device(paged_kv_indices_buf, "paged_kv_indices_buf", self._device)
            self._graph_indices = paged_kv_indices_buf

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, **unsupported) -> None:
        """Schedule a batch: qo_indptr [batch+1] (query tokens), paged_kv_indptr [batch+1] (pages) and
        paged_kv_last_page_len [batch] are int32 host tensors; paged_kv_indices holds the page ids."""
        _refuse(unsupported)
        self._plan_batch(
            qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, indices=paged_kv_indices,
            last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
            use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, o_data_type=o_data_type, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv)

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None, window_left: int | None = None, sinks=None):
        """Attention of q [qo_indptr[-1], num_qo_heads, head_dim_qk] over the planned pages. Returns o,
        or (o, lse) with lse [qo_indptr[-1], num_qo_heads] fp32 base 2."""
        plan = self._require_plan()
        checks.run_extras(plan.window_left, enable_pdl, window_left, sinks, "the prefill kernels")
        k_cache, v_cache = kv_cache.split_paged(paged_kv_cache, self._kv_layout, plan.page_size, plan.num_kv_heads,
                                                plan.head_dim_qk, plan.head_dim_vo, plan.dtype_kv, self._device)
        num_pages = k_cache.shape[0]
        if plan.host_max_page is not None and plan.host_max_page >= num_pages:
            raise ValueError(f"paged_kv_indices: page id {plan.host_max_page} is out of range for a cache of "
                             f"{num_pages} pages")
        strides = kv_cache.paged_strides(k_cache, self._kv_layout)
        if kv_cache.paged_strides(v_cache, self._kv_layout) != strides:
            # The kernel resolves each page id once per tile into one row offset for K and V.
            raise ValueError(f"paged_kv_cache: k and v caches must have equal (page, token, head) strides, got "
                             f"{strides} and {kv_cache.paged_strides(v_cache, self._kv_layout)}; with head_dim_vo < "
                             "head_dim_qk store V in pages of K's shape and pass v_cache[..., :head_dim_vo]")
        return self._launch(q, k_cache, v_cache, strides, strides, num_pages, args, q_scale, k_scale, v_scale, out,
                            lse, return_lse)

    forward = run

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillWrapper):
    """Prefill attention of ragged queries over ragged (contiguous per request) keys and values,
    with FlashInfer's constructor, plan() and run() arguments. LSE is base 2."""

    _paged = False

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, jit_args, jit_kwargs)

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, **unsupported) -> None:
        """Schedule a batch: qo_indptr and kv_indptr [batch+1] are int32 host token indptrs."""
        _refuse(unsupported)
        self._plan_batch(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, indices=None, last_page_len=None, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=1,
            custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale,
            window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv)

    begin_forward = plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, q_scale=None, k_scale=None,
            v_scale=None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None, window_left: int | None = None, sinks=None):
        """Attention of q [qo_indptr[-1], num_qo_heads, head_dim_qk] over k [kv_indptr[-1], num_kv_heads,
        head_dim_qk] and v [..., head_dim_vo] (NHD; HND puts heads first)."""
        plan = self._require_plan()
        checks.run_extras(plan.window_left, enable_pdl, window_left, sinks, "the prefill kernels")
        kv_cache.check_ragged(k, v, self._kv_layout, plan.total_kv, plan.num_kv_heads, plan.head_dim_qk,
                              plan.head_dim_vo, plan.dtype_kv, self._device)
        k_token, k_head = kv_cache.ragged_strides(k, self._kv_layout)
        v_token, v_head = kv_cache.ragged_strides(v, self._kv_layout)
        # A ragged cache is a paged one of one-token pages: num_pages carries its rows (fa3 boxes them by TMA).
        return self._launch(q, k, v, (0, k_token, k_head), (0, v_token, v_head), plan.total_kv, args, q_scale, k_scale,
                            v_scale, out, lse, return_lse)

    forward = run

    def run_return_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs):
        return self.run(q, k, v, *args, return_lse=True, **kwargs)


_single_workspaces: dict[torch.device, torch.Tensor] = {}
SINGLE_WORKSPACE_BYTES = 64 << 20


def single_prefill_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q=None, scale_k=None,
                                 scale_v=None, o_dtype=None, custom_mask=None, packed_custom_mask=None,
                                 causal: bool = False, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
                                 window_left: int = -1, logits_soft_cap: float | None = None,
                                 rope_scale: float | None = None, rope_theta: float | None = None,
                                 backend: str = "auto", return_lse: bool = False):
    """Prefill attention of one request: q [qo_len, num_qo_heads, head_dim_qk] over k/v
    [kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.tensor(x, name)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor, got shape {tuple(x.shape)}")
    kv_cache.check_layout(kv_layout)
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    workspace = _single_workspaces.get(q.device)
    if workspace is None:
        workspace = _single_workspaces[q.device] = torch.empty(SINGLE_WORKSPACE_BYTES, dtype=torch.uint8,
                                                               device=q.device)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout, backend=backend)
    wrapper.plan(torch.tensor([0, q.shape[0]], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
                 q.shape[1], num_kv_heads, q.shape[2], v.shape[2], custom_mask=custom_mask,
                 packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
                 use_fp16_qk_reduction=use_fp16_qk_reduction, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                 q_data_type=q.dtype, kv_data_type=k.dtype, o_data_type=o_dtype)
    return wrapper.run(q, k, v, q_scale=scale_q, k_scale=scale_k, v_scale=scale_v, return_lse=return_lse)


# FlashInfer plan() arguments for features these kernels do not have (multi-item scoring, the
# trtllm-gen and cuDNN backends): accepted at their defaults, refused otherwise.
_FLASHINFER_ONLY = frozenset({"prefix_len_ptr", "token_pos_in_items_ptr", "token_pos_in_items_len", "max_item_len_ptr",
                              "seq_lens", "seq_lens_q", "block_tables", "max_token_per_sequence", "max_sequence_kv",
                              "v_indptr"})


def _refuse(unsupported: dict) -> None:
    unknown = sorted(set(unsupported) - _FLASHINFER_ONLY)
    if unknown:
        raise TypeError(f"plan() got unexpected keyword argument(s): {', '.join(unknown)}")
    # their defaults are None or 0 (token_pos_in_items_len); anything else asks for the feature
    given = [name for name, value in unsupported.items()
             if value is not None and not (isinstance(value, (int, float)) and value == 0)]
    if given:
        raise ValueError(f"plan(): {', '.join(sorted(given))} not supported by attnforge's prefill kernels "
                         "(multi-item scoring, trtllm-gen and cuDNN arguments); leave them unset")
