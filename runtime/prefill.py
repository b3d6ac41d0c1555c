"""Batch prefill over a paged or ragged KV cache: FlashInfer's BatchPrefillWithPagedKVCacheWrapper
and BatchPrefillWithRaggedKVCacheWrapper, and single_prefill_with_kv_cache.

plan() validates the index arrays on the host, derives the kernel spec (building the module on
first use), schedules (request, q tile, kv chunk) work items through the module's C++ planner and
uploads the plan with one asynchronous copy: the steps of prefill_plan_steps, called in order.
run() checks tensor metadata, patches pointers into the parameter struct and launches on the
caller's current stream without waiting for the GPU. While torch.compile traces, run() and
single_prefill_with_kv_cache are custom ops instead (runtime/compile_ops.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
from torch.compiler import is_compiling

from attnforge.codegen.abi import PLAN_ERROR_BAD_PAGE, PLAN_HEADER

from . import call_knobs, checks, compile_ops, dispatch, kv_cache
from .loader import Module
from .run_args import Accepted, checked_paged
from .plan_buffers import PlanImage, cuda_index, current_stream, float_workspace, lse_output, output, score_scales
from .prefill_plan_steps import (
    KernelOptions,
    PlanRequest,
    build_params,
    carve_workspace,
    check_bounds,
    check_options,
    check_request,
    one_token_requests,
    resolve_module,
    schedule,
    stage_mask,
)
from .settings import settings


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
    fp8_query: bool = False
    accepted: Accepted = field(default_factory=Accepted)  # tensor forms run() checked in full
    scales: tuple[float, float] | None = None  # the (q_scale, k_scale) folded into params; None: none yet


# The kernel options both plan()s take under the same names, passed on to check_options.
_OPTION_ARGS = ("custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "sm_scale",
                "window_left", "logits_soft_cap", "rope_scale", "rope_theta", "q_data_type", "kv_data_type",
                "o_data_type", "fixed_split_size", "disable_split_kv")


def _option_args(plan_locals: dict) -> dict:
    return {name: plan_locals[name] for name in _OPTION_ARGS}


class _BatchPrefillWrapper:
    """plan()/run() machinery shared by the paged and ragged wrappers."""

    _paged: bool

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool, backend: str,
                 jit_args, jit_kwargs) -> None:
        self._workspace = float_workspace(float_workspace_buffer)
        self._device = float_workspace_buffer.device
        self._device_index = cuda_index(self._device)
        self._kv_layout = kv_cache.check_layout(kv_layout)
        if jit_args is not None or jit_kwargs is not None:
            raise ValueError("jit_args/jit_kwargs: custom attention variants are not supported; leave them None")
        self._backend = dispatch.parse_backend(backend)
        self._graph = bool(use_cuda_graph)
        self._graph_shape: tuple[int, int] | None = None  # (batch, rows) the first graph plan fixed
        self._graph_indices: torch.Tensor | None = None  # paged under CUDA graphs: where page ids are staged
        self._image = PlanImage(self._device, fixed_address=self._graph)
        self._plan: _Plan | None = None
        self._planned: tuple[PlanRequest, KernelOptions] | None = None  # what forward() plans again from
        self._debug = settings().debug
        # Set by the tensor-core decode wrapper, whose plans have one query token per request: a
        # CUDA-graph replay keeps the kernel it captured, so only such a wrapper may promise it.
        self._decode_plans = False
        self._handle = compile_ops.register(self)  # how a torch.compile graph names this wrapper

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph

    # ------------------------------------------------------------------ plan
    def _plan_batch(self, request: PlanRequest, options: KernelOptions) -> None:
        """Resolve the module, stage the page ids, schedule through the module's C++ planner, stage the
        mask and the workspace, upload the image: the steps of prefill_plan_steps, in order."""
        check_bounds(request, options)
        self._planned = (request, options)
        device_index = cuda_index(self._device)
        module = resolve_module(self._backend, request, options, device_index)
        indices, host_max_page = None, None
        if request.paged:
            indices, host_max_page = kv_cache.stage_page_ids(request.indices, request.total_kv, self._device,
                                                             "paged_kv_indices", self._graph_indices,
                                                             "paged_kv_indices_buf")
        sched = schedule(module, request, options, self._rows(request.batch_size, request.total_q),
                         indices.numel() if request.paged else request.total_kv, self._image, self._graph,
                         device_index)
        mask = stage_mask(request, options, sched, self._device) if options.use_custom_mask else None
        space = carve_workspace(request, options, sched, self._workspace, self._graph)
        self._image.upload(sched.image_size)
        # The planner checked qo_indptr (from 0, non-decreasing): more rows than requests rules one token out.
        one_token = self._decode_plans if self._graph else (request.total_q <= request.batch_size
                                                            and one_token_requests(request.qo_indptr))
        params = build_params(module, request, options, sched, space, indices=indices, mask=mask,
                              plan_ptr=self._image.on_device.data_ptr(), workspace_ptr=self._workspace.data_ptr(),
                              graph=self._graph, one_token=one_token, debug=self._debug, device_index=device_index)
        self._plan = _Plan(
            module=module, params=params, total_q=request.total_q, total_kv=request.total_kv,
            num_qo_heads=request.num_qo_heads, num_kv_heads=request.num_kv_heads, head_dim_qk=request.head_dim_qk,
            head_dim_vo=request.head_dim_vo, page_size=request.page_size,
            dtype_q=dispatch.torch_dtype(options.dtype_q), dtype_kv=dispatch.torch_dtype(options.dtype_kv),
            dtype_o=dispatch.torch_dtype(options.dtype_o), sm_scale=options.sm_scale, soft_cap=options.soft_cap,
            window_left=options.window_left, host_max_page=host_max_page,
            keep_alive=tuple(t for t in (indices, mask) if t is not None), fp8_query=options.dtype_q.is_fp8)

    def _rows(self, batch_size: int, total_q: int) -> int:
        """Query rows the plan covers: the batch's, or under CUDA graphs the first plan's, which fixes
        the batch size and caps the rows of every later plan."""
        if not self._graph:
            return total_q
        if self._graph_shape is None:
            self._graph_shape = (batch_size, total_q)
        elif batch_size != self._graph_shape[0] or total_q > self._graph_shape[1]:
            raise ValueError(f"qo_indptr: this CUDA-graph wrapper was planned for batch_size={self._graph_shape[0]} "
                             f"and at most {self._graph_shape[1]} query tokens, got {batch_size} and {total_q}")
        return self._graph_shape[1]

    # ------------------------------------------------------------------ run
    def _launch(self, q: torch.Tensor, k_ptr: int, v_ptr: int, k_strides: tuple, v_strides: tuple,
                num_pages: int, args: tuple, q_scale, k_scale, v_scale, out, lse, return_lse: bool,
                enable_pdl: bool | None, sinks) -> object:
        plan = self._plan
        accepted = plan.accepted
        if args or plan.fp8_query or q_scale is not None or k_scale is not None or v_scale is not None:
            q_scale, k_scale, v_scale = checks.positional_scales(args, plan.fp8_query, q_scale, k_scale, v_scale)
            q_scale, k_scale, v_scale = self._scales(plan.fp8_query, q_scale, k_scale, v_scale)
        accepted.ensure(q, "q", self._check_q)
        out_shape = (plan.total_q, plan.num_qo_heads, plan.head_dim_vo)
        if out is None:
            out = torch.empty(out_shape, dtype=plan.dtype_o, device=self._device)
        else:
            accepted.ensure(out, "out", lambda out: output(out, "out", out_shape, plan.dtype_o, self._device,
                                                           "[qo_indptr[-1], num_qo_heads, head_dim_vo]"))
        if return_lse:
            lse = lse_output(lse, (plan.total_q, plan.num_qo_heads), self._device, "[qo_indptr[-1], num_qo_heads]")
        params = plan.params
        scales = (q_scale or 1.0, k_scale or 1.0)
        if scales != plan.scales:
            self._set_scales(scales)
        params.q, params.k, params.v = q.data_ptr(), k_ptr, v_ptr
        params.o, params.lse = out.data_ptr(), lse.data_ptr() if return_lse else None
        params.sinks = accepted.sinks_ptr(sinks, plan.num_qo_heads, self._device)
        params.q_stride_n, params.q_stride_h = q.stride(0), q.stride(1)
        params.o_stride_n, params.o_stride_h = out.stride(0), out.stride(1)
        params.kv_stride_page, params.kv_stride_token, params.kv_stride_head = k_strides
        params.v_stride_page, params.v_stride_token, params.v_stride_head = v_strides
        params.num_pages = num_pages
        params.q_tokens = q.shape[0]
        params.enable_pdl = dispatch.pdl_flag(enable_pdl, self._device_index)
        stream = current_stream(self._device_index)
        plan.module.check(plan.module.fns["prefill_run"](ctypes.byref(params), stream), "prefill run")
        checked = params.debug_sync and not torch.cuda.is_current_stream_capturing()  # a captured run runs at replay
        if checked and self._image.read_slot(PLAN_HEADER.index("error")) & PLAN_ERROR_BAD_PAGE:
            raise RuntimeError(f"{plan.module.spec.uri}: {plan.module.spec.backend.value}::prefill_kernel read a page id "
                               f"outside [0, {num_pages}) from paged_kv_indices; the affected outputs are NaN")
        if v_scale is not None and v_scale != 1.0:
            out.mul_(v_scale)
        return (out, lse) if return_lse else out

    def _check_q(self, q) -> None:
        plan = self._plan
        checks.planned_tensor(q, "q", (plan.total_q, plan.num_qo_heads, plan.head_dim_qk),
                              "[qo_indptr[-1], num_qo_heads, head_dim_qk]", planned_dtype=plan.dtype_q,
                              dtype_arg="q_data_type", on=self._device)

    def _set_scales(self, scales: tuple[float, float]) -> None:
        """Fold (q_scale, k_scale) into the planned softmax scale; run() calls it only when they change."""
        plan = self._plan
        plan.params.sm_scale_log2, plan.params.soft_cap_log2 = score_scales(plan.sm_scale * scales[0] * scales[1],
                                                                            plan.soft_cap)
        plan.scales = scales

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

    def _apply_call_knobs(self, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                          sm_scale, rope_scale, rope_theta) -> None:
        """FlashInfer's deprecated forward(): its knobs replace plan()'s, scalars in place, anything
        else by planning the same batch again (see call_knobs)."""
        if self._planned is None:
            raise RuntimeError("forward() called before plan(): call plan() (or begin_forward()) first")
        if use_fp16_qk_reduction:
            raise ValueError("use_fp16_qk_reduction: the prefill kernels accumulate q.k in fp32; pass False")
        request, options = self._planned
        given = call_knobs.normalized(request.head_dim_qk, pos_encoding_mode=pos_encoding_mode,
                                      window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                                      rope_scale=rope_scale, rope_theta=rope_theta,
                                      causal=causal and not options.use_custom_mask)
        planned = {"pos_encoding": options.pos_encoding, "window_left": options.window_left,
                   "soft_cap": options.soft_cap, "sm_scale": options.sm_scale, "rope_scale": options.rope_scale,
                   "rope_theta": options.rope_theta, "causal": options.causal}
        names = call_knobs.changed(given, planned)
        if not names:
            return
        if call_knobs.needs_new_plan(names, given, planned):
            self._plan_batch(request, dataclasses.replace(options, **given))
            return
        self._plan.sm_scale, self._plan.soft_cap = given["sm_scale"], given["soft_cap"]
        self._plan.scales = None  # the next run() folds its scales into the new sm_scale
        options.sm_scale, options.soft_cap = given["sm_scale"], given["soft_cap"]

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
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0, max_item_len_ptr=None, seq_lens=None,
             seq_lens_q=None, block_tables=None, max_token_per_sequence=None, max_sequence_kv=None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False, uniform_q_len: int | None = None,
             use_token_head_sf: bool = False) -> None:
        """Schedule a batch: qo_indptr [batch+1] (query tokens), paged_kv_indptr [batch+1] (pages) and
        paged_kv_last_page_len [batch] are int32 host tensors; paged_kv_indices holds the page ids.
        Positional order and meanings are FlashInfer 0.7.4's; with a custom mask, causal is ignored
        (the mask decides), as FlashInfer documents."""
        _refuse(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr, seq_lens=seq_lens,
                seq_lens_q=seq_lens_q, block_tables=block_tables, max_token_per_sequence=max_token_per_sequence,
                max_sequence_kv=max_sequence_kv, use_token_head_sf=use_token_head_sf)
        request = check_request(
            paged=True, qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, indices=paged_kv_indices,
            last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size)
        self._plan_batch(request, check_options(head_dim_qk=request.head_dim_qk, **_option_args(locals())))

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            lse_base: str = "log2", lse_layout: str = "NH", enable_pdl: bool | None = None,
            window_left: int | None = None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor: float | None = None, use_fp16_softmax: bool | None = None,
            uses_spcompress: bool | None = None):
        """Attention of q [qo_indptr[-1], num_qo_heads, head_dim_qk] over the planned pages. Returns o,
        or (o, lse) with lse [qo_indptr[-1], num_qo_heads] fp32 base 2. enable_pdl: programmatic
        dependent launch (None: where the device is sm90+; True on an older device is off).
        sinks: None, or gpt-oss attention sinks, a float32 tensor [num_qo_heads] on the device: one
        logit per query head, in the units of the scaled scores s_j (natural log, not multiplied by
        sm_scale), added to each row's softmax denominator as a key with no value:
        o = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)); lse includes it,
        lse = log2(2^(sink*log2(e)) + sum_j 2^(s_j*log2(e)))."""
        plan = self._require_plan()
        if (lse_base, lse_layout) != ("log2", "NH") or kv_cache_sf is not None or use_fp16_softmax or \
                skip_softmax_threshold_scale_factor is not None or uses_spcompress:
            _refuse_run(lse_base=lse_base, lse_layout=lse_layout, kv_cache_sf=kv_cache_sf,
                        skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                        use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress)
        if is_compiling():
            return compile_ops.batch_run("batch_prefill_paged", self, plan.dtype_o, q, paged_kv_cache, args, q_scale,
                                         k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left, sinks)
        if enable_pdl is not None or window_left is not None:
            checks.run_extras(plan.window_left, enable_pdl, window_left)
        cache = plan.accepted.paged(paged_kv_cache, self._check_cache)
        if plan.host_max_page is not None and plan.host_max_page >= cache.num_pages:
            raise ValueError(f"paged_kv_indices: page id {plan.host_max_page} is out of range for a cache of "
                             f"{cache.num_pages} pages")
        return self._launch(q, cache.k_ptr, cache.v_ptr, cache.strides, cache.strides, cache.num_pages, args, q_scale,
                            k_scale, v_scale, out, lse, return_lse, enable_pdl, sinks)

    def _check_cache(self, paged_kv_cache):
        plan = self._plan
        return checked_paged(paged_kv_cache, self._kv_layout, plan.page_size, plan.num_kv_heads, plan.head_dim_qk,
                             plan.head_dim_vo, plan.dtype_kv, self._device)

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def forward(self, q: torch.Tensor, paged_kv_cache, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, k_scale=None, v_scale=None, window_left: int = -1,
                logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
                rope_theta: float | None = None):
        """Deprecated (FlashInfer's): run() with these knobs replacing plan()'s (see call_knobs)."""
        self._apply_call_knobs(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q: torch.Tensor, paged_kv_cache, causal: bool = False,
                           pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, k_scale=None,
                           v_scale=None, window_left: int = -1, logits_soft_cap: float | None = None,
                           sm_scale: float | None = None, rope_scale: float | None = None,
                           rope_theta: float | None = None):
        """Deprecated (FlashInfer's): run_return_lse() with these knobs replacing plan()'s."""
        self._apply_call_knobs(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


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
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0, max_item_len_ptr=None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False, seq_lens=None, seq_lens_q=None,
             max_token_per_sequence=None, max_sequence_kv=None, v_indptr=None, o_indptr=None, qo_indptr_cpu=None,
             kv_indptr_cpu=None, uniform_q_len: int | None = None, use_token_head_sf: bool = False) -> None:
        """Schedule a batch: qo_indptr and kv_indptr [batch+1] are int32 token indptrs (host tensors,
        or their host mirrors qo_indptr_cpu/kv_indptr_cpu). o_indptr, as in FlashInfer's fa2/fa3
        path, is taken and not used: the output rows follow qo_indptr."""
        _refuse(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr, seq_lens=seq_lens,
                seq_lens_q=seq_lens_q, max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv,
                v_indptr=v_indptr, use_token_head_sf=use_token_head_sf)
        request = check_request(
            paged=False, qo_indptr=qo_indptr if qo_indptr_cpu is None else qo_indptr_cpu,
            kv_indptr=kv_indptr if kv_indptr_cpu is None else kv_indptr_cpu, indices=None, last_page_len=None,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=1)
        self._plan_batch(request, check_options(head_dim_qk=request.head_dim_qk, **_option_args(locals())))

    begin_forward = plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, q_scale=None, k_scale=None,
            v_scale=None, o_scale=None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, lse_base: str = "log2", lse_layout: str = "NH", enable_pdl: bool | None = None,
            kv_cache_sf=None, window_left: int | None = None, sinks=None):
        """Attention of q [qo_indptr[-1], num_qo_heads, head_dim_qk] over k [kv_indptr[-1], num_kv_heads,
        head_dim_qk] and v [..., head_dim_vo] (NHD; HND puts heads first). enable_pdl and sinks (gpt-oss
        attention sinks, fp32 [num_qo_heads], counted in lse) as in the paged wrapper's run()."""
        plan = self._require_plan()
        if (lse_base, lse_layout) != ("log2", "NH") or kv_cache_sf is not None or o_scale not in (None, 1.0):
            _refuse_run(lse_base=lse_base, lse_layout=lse_layout, kv_cache_sf=kv_cache_sf, o_scale=o_scale)
        if is_compiling():
            return compile_ops.batch_run("batch_prefill_ragged", self, plan.dtype_o, q, (k, v), args, q_scale,
                                         k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left, sinks)
        checks.run_extras(plan.window_left, enable_pdl, window_left)
        # full checks once per tensor form and plan, as the paged cache's: run() is called every step and layer
        for x, name, dim in ((k, "k", plan.head_dim_qk), (v, "v", plan.head_dim_vo)):
            plan.accepted.ensure(x, name, lambda x, name=name, dim=dim: kv_cache.check_ragged(
                x, name, self._kv_layout, plan.total_kv, plan.num_kv_heads, dim, plan.dtype_kv, self._device))
        k_token, k_head = kv_cache.ragged_strides(k, self._kv_layout)
        v_token, v_head = kv_cache.ragged_strides(v, self._kv_layout)
        # A ragged cache is a paged one of one-token pages: num_pages carries its rows (fa3 boxes them by TMA).
        return self._launch(q, k.data_ptr(), v.data_ptr(), (0, k_token, k_head), (0, v_token, v_head), plan.total_kv,
                            args, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, sinks)

    def run_return_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs):
        return self.run(q, k, v, *args, return_lse=True, **kwargs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, window_left: int = -1,
                logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
                rope_theta: float | None = None):
        """Deprecated (FlashInfer's): run() with these knobs replacing plan()'s (see call_knobs)."""
        self._apply_call_knobs(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run(q, k, v)

    def forward_return_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                           window_left: int = -1, logits_soft_cap: float | None = None,
                           sm_scale: float | None = None, rope_scale: float | None = None,
                           rope_theta: float | None = None):
        """Deprecated (FlashInfer's): run_return_lse() with these knobs replacing plan()'s."""
        self._apply_call_knobs(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                               sm_scale, rope_scale, rope_theta)
        return self.run(q, k, v, return_lse=True)


_single_workspaces: dict[torch.device, torch.Tensor] = {}
SINGLE_WORKSPACE_BYTES = 64 << 20


def single_prefill_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q=None, scale_k=None,
                                 scale_v=None, o_dtype=None, custom_mask=None, packed_custom_mask=None,
                                 causal: bool = False, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                 use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
                                 window_left: int = -1, logits_soft_cap: float | None = None,
                                 rope_scale: float | None = None, rope_theta: float | None = None,
                                 backend: str = "auto", return_lse: bool = False, kv_cache_sf=None,
                                 k_scale: float | None = None, v_scale: float | None = None):
    """Prefill attention of one request: q [qo_len, num_qo_heads, head_dim_qk] over k/v
    [kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND).
    scale_q/scale_k/scale_v are the fp8 query path's scales (run()'s q_scale/k_scale/v_scale);
    k_scale and v_scale are FlashInfer's float calibration scales of a quantized KV: k_scale
    multiplies sm_scale, v_scale the output."""
    if is_compiling():
        return compile_ops.single_prefill(q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask,
                                          causal, kv_layout, pos_encoding_mode, use_fp16_qk_reduction, sm_scale,
                                          window_left, logits_soft_cap, rope_scale, rope_theta, backend, return_lse,
                                          kv_cache_sf, k_scale, v_scale)
    # Metadata checks first: a CPU tensor is named here, before any CUDA work.
    kv_len, num_kv_heads = kv_cache.check_single(q, k, v, 3, kv_layout)
    if kv_cache_sf is not None:
        raise ValueError("kv_cache_sf: per-(token, head) KV scale factors are not supported; leave it None")
    k_scale, v_scale = checks.scale(k_scale, "k_scale"), checks.scale(v_scale, "v_scale")
    if k_scale is not None:
        sm_scale = checks.positive_float(sm_scale, "sm_scale", 1.0 / math.sqrt(q.shape[2])) * k_scale
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
    result = wrapper.run(q, k, v, q_scale=scale_q, k_scale=scale_k, v_scale=scale_v, return_lse=return_lse)
    if v_scale is not None and v_scale != 1.0:
        (result[0] if return_lse else result).mul_(v_scale)
    return result


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
single_prefill_with_kv_cache_return_lse.__doc__ = """single_prefill_with_kv_cache with return_lse=True: (o, lse)."""


def _refuse(**flashinfer_only) -> None:
    """FlashInfer plan() arguments for features these kernels do not have (multi-item scoring,
    per-(token, head) KV scales, the trtllm-gen and cuDNN backends): accepted at their defaults
    (None, 0 or False), refused by name otherwise."""
    given = [name for name, value in flashinfer_only.items()
             if value is not None and not (isinstance(value, (int, float)) and value == 0)]
    if given:
        raise ValueError(f"plan(): {', '.join(sorted(given))} not supported by attnforge's prefill kernels "
                         "(multi-item scoring, per-(token, head) KV scales, trtllm-gen and cuDNN arguments); "
                         "leave them unset")


def _refuse_run(**flashinfer_only) -> None:
    """FlashInfer run() arguments for what these kernels do not do (natural-log or head-major LSE,
    per-(token, head) KV scales, fp16 softmax, skip-softmax, output scales): named when given."""
    neutral = {"lse_base": "log2", "lse_layout": "NH", "o_scale": 1.0}
    given = sorted(f"{name}={value!r}" for name, value in flashinfer_only.items()
                   if value not in (None, False, neutral.get(name)))
    raise ValueError(f"run(): {', '.join(given)} not supported by attnforge's prefill kernels (LSE is base 2, "
                     "[tokens, heads]); leave them at their defaults")
