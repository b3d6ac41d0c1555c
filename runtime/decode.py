"""Batch decode over a paged KV cache: FlashInfer's BatchDecodeWithPagedKVCacheWrapper API.

plan() validates the page table, derives the kernel spec from its arguments (building the module
on first use), schedules on the host through the module's C++ planner, and has the module upload
the plan with one asynchronous copy. run() checks its tensors' metadata, patches their pointers
into the parameter struct built by plan(), and launches on the caller's current stream: it never
waits for the GPU, so it can be captured in a CUDA graph. While torch.compile traces, run() and
single_decode_with_kv_cache are custom ops instead (runtime/compile_ops.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch.compiler import is_compiling

from attnforge.codegen.abi import PLAN_ERROR_BAD_PAGE, PLAN_HEADER
from attnforge.codegen.dtypes import DType
from attnforge.codegen.kv_tiles import decode_kv_tile
from attnforge.codegen.spec import PosEncoding

from . import call_knobs, checks, compile_ops, dispatch, kv_cache
from .loader import Module, load
from .run_args import Accepted, checked_paged
from .plan_buffers import (PlanImage, cuda_index, current_stream, lse_output, num_sms, output, score_scales,
                           split_tokens)
from .planner import (
    MAX_CTAS_PER_SM_BOUND,
    MIN_CHUNK_TOKENS,
    PlanLayout,
    heads_per_cta,
    partial_bytes,
    work_capacity,
)
from .decode_inputs import (
    DecodeKnobs,
    DecodePlanInputs,
    check_knobs,
    check_kv_covers_queries,
    check_q_len,
    refuse_extras,
    refuse_run_extras,
    resolve_data_type,
)
from .settings import settings

@functools.cache
def _decode_module(backend: str, dtype_q: DType, dtype_kv: DType, dtype_o: DType, head_dim: int,
                   pos_encoding: PosEncoding, use_sliding_window: bool, use_logits_soft_cap: bool,
                   device_index: int) -> Module:
    """The decode module for planned arguments; cached so a steady-state plan() costs no spec
    hashing or file-system checks (refusals raise and are not cached)."""
    spec = dispatch.decode_spec(
        backend=backend, dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_o, head_dim=head_dim,
        pos_encoding=pos_encoding, use_sliding_window=use_sliding_window,
        use_logits_soft_cap=use_logits_soft_cap, archs=dispatch.device_archs(device_index))
    return load(spec)


@functools.cache
def _layout(batch_size: int, capacity: int, ctas_per_request: int) -> tuple[dict[str, int], int]:
    """(offsets, size) of the plan image; cached, a serving engine replans the same shapes every step."""
    layout = PlanLayout(batch_size, capacity, ctas_per_request)
    return layout.offsets(), layout.size


# Serving engines replan every step with a handful of batch sizes: a few hundred shapes cover them.
@functools.lru_cache(maxsize=256)
def _struct_templates(module: Module, batch_size: int, num_qo_heads: int, num_kv_heads: int, page_size: int,
                      window_left: int, fixed_tokens: int, disable_split_kv: bool, capacity: int, max_ctas: int,
                      device_index: int, debug: bool) -> tuple[ctypes.Structure, ctypes.Structure]:
    """(DecodePlanArgs, DecodeParams) holding every field that depends only on the plan's shapes;
    plan() copies them and stores the per-call pointers and counts (a ctypes constructor with ~20
    keywords costs several µs, a copy and a few stores well under one)."""
    heads, tiles = heads_per_cta(num_qo_heads // num_kv_heads)
    offsets, image_size = _layout(batch_size, capacity, num_kv_heads * tiles)
    binding = module.binding
    args = binding.DecodePlanArgs(
        batch_size=batch_size, page_size=page_size, ctas_per_request=num_kv_heads * tiles, max_ctas=max_ctas,
        window_left=window_left, fixed_split_tokens=fixed_tokens, disable_split_kv=int(disable_split_kv),
        min_chunk_tokens=MIN_CHUNK_TOKENS, chunk_align_tokens=decode_kv_tile(module.spec, heads),
        work_capacity=capacity, image_size=image_size, device=device_index, **offsets)
    params = binding.DecodeParams(
        batch_size=batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        group_size=num_qo_heads // num_kv_heads, heads_per_cta=heads, num_head_tiles=tiles, page_size=page_size,
        device=device_index, debug_sync=int(debug), **offsets)
    return args, params


@functools.cache
def _max_ctas(module: Module, heads: int, device_index: int) -> int:
    ctas_per_sm = ctypes.c_int32()
    module.check(module.fns["decode_occupancy"](heads, device_index, ctypes.byref(ctas_per_sm)), "decode occupancy query")
    return num_sms(device_index) * max(ctas_per_sm.value, 1)


def decode_workspace_size(batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, device=None) -> int:
    """Bytes of float workspace that any decode plan of this shape fits in (split-KV partials).
    Use it to size `float_workspace_buffer`; plan() reports the exact need when a buffer is short.
    device: a CUDA device (None: the current one), whose SM count bounds the split."""
    checks.positive_int(batch_size, "batch_size")
    num_qo_heads, num_kv_heads = checks.heads(num_qo_heads, num_kv_heads)
    checks.positive_int(head_dim, "head_dim")
    index = checks.cuda_device(device).index
    group = num_qo_heads // num_kv_heads
    _, tiles = heads_per_cta(max(group, 1))
    capacity = work_capacity(batch_size, num_sms(index) * MAX_CTAS_PER_SM_BOUND, num_kv_heads * tiles)
    v_bytes, s_bytes = partial_bytes(capacity, num_qo_heads, head_dim)
    return v_bytes + s_bytes


@dataclass
class _Plan:
    """What run() needs from plan()."""

    module: Module
    params: ctypes.Structure
    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype_q: torch.dtype
    dtype_kv: torch.dtype
    dtype_o: torch.dtype
    sm_scale: float
    soft_cap: float
    window_left: int
    host_max_page: int | None  # known when indices came from the host
    indices: torch.Tensor  # kept alive: the kernel reads it
    accepted: Accepted = field(default_factory=Accepted)  # tensor forms run() checked in full
    scales: tuple[float, float] = (1.0, 1.0)  # the (q_scale, k_scale) folded into params


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode attention for a batch of requests, each one query token (or, on the tensor-core path,
    q_len_per_req tokens, causal among them) against its paged KV.

    Same constructor, plan() and run() arguments as FlashInfer's wrapper. LSE is base 2:
    log2(sum_j exp(s_j)) where s_j are the scaled (soft-capped) logits.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None) -> None:
        checks.tensor(float_workspace_buffer, "float_workspace_buffer")
        if not float_workspace_buffer.is_cuda or not float_workspace_buffer.is_contiguous():
            raise ValueError("float_workspace_buffer: expected a contiguous CUDA tensor, got "
                             f"{'a non-contiguous' if float_workspace_buffer.is_cuda else 'a ' + str(float_workspace_buffer.device)} tensor")
        kv_cache.check_layout(kv_layout)
        if jit_args is not None or jit_kwargs is not None:
            raise ValueError("jit_args/jit_kwargs: custom attention variants are not supported; leave them None")
        self._backend = dispatch.parse_backend(backend)
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._device_index = cuda_index(self._device)
        self._kv_layout = kv_layout
        self._graph = bool(use_cuda_graph)
        self._graph_batch_size = None
        self._graph_indices = None
        if self._graph:
            self._check_graph_buffers(paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            self._graph_indices = paged_kv_indices_buffer
            if paged_kv_indptr_buffer is not None:
                self._graph_batch_size = paged_kv_indptr_buffer.numel() - 1
        # FlashInfer's names for the buffers engines write between plan() and a graph replay: the
        # kernels read the page ids; plan() keeps indptr and last_page_len there for the engine.
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer if self._graph else None
        self._paged_kv_indices_buf = paged_kv_indices_buffer if self._graph else None
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer if self._graph else None
        self._fixed_batch_size = self._graph_batch_size or 0
        self._qo_indptr_buf = None
        self._graph_q_len: int | None = None  # the q_len_per_req a CUDA-graph tensor-core wrapper is fixed to
        if self._graph and use_tensor_cores and self._graph_batch_size is not None:
            self._qo_indptr_buf = torch.arange(self._graph_batch_size + 1, dtype=torch.int32, device=self._device)
        self._plan_inputs: DecodePlanInputs | None = None  # what forward() and fast_decode_plan plan again from
        self._plan_call: tuple[torch.Tensor | None, bool] = (None, False)  # that plan's (host_indptr, reuse)
        self._knobs: DecodeKnobs | None = None
        self._image = PlanImage(self._device, fixed_address=self._graph)
        weakref.finalize(self, self._image.staging.retire).atexit = False
        self._plan: _Plan | None = None
        self._debug = settings().debug  # ATTNFORGE_DEBUG, read once per wrapper
        self._handle = compile_ops.register(self)  # how a torch.compile graph names this wrapper
        # use_tensor_cores: decode runs on the prefill kernels, one query row per request with the
        # GQA group packed into the tile's rows (FlashInfer's tensor-core decode).
        self._tensor_cores = None
        if use_tensor_cores:
            from .prefill import BatchPrefillWithPagedKVCacheWrapper

            # "auto" is fa2 here, as in FlashInfer: the fa3 kernel's 128-row tile would hold one
            # request's group (<= 8 rows) and run mostly empty.
            self._tensor_cores = BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer, kv_layout, use_cuda_graph, paged_kv_indices_buf=paged_kv_indices_buffer,
                backend="fa2" if self._backend == "auto" else self._backend)
            self._tensor_cores._decode_plans = True

    def _check_graph_buffers(self, indptr_buffer, indices_buffer, last_page_len_buffer) -> None:
        if indices_buffer is None:
            raise ValueError("paged_kv_indices_buffer: use_cuda_graph=True needs a preallocated int32 CUDA buffer "
                             "for the page ids, so the captured kernels read a fixed address")
        for name, buffer in (("paged_kv_indptr_buffer", indptr_buffer), ("paged_kv_indices_buffer", indices_buffer),
                             ("paged_kv_last_page_len_buffer", last_page_len_buffer)):
            if buffer is not None:
                checks.tensor(buffer, name)
                checks.dtype(buffer, name, torch.int32)
                checks.device(buffer, name, self._device)
        if indptr_buffer is not None and last_page_len_buffer is not None and \
                indptr_buffer.numel() != last_page_len_buffer.numel() + 1:
            raise ValueError(f"paged_kv_indptr_buffer: expected batch_size + 1 = {last_page_len_buffer.numel() + 1} "
                             f"entries (one more than paged_kv_last_page_len_buffer), got {indptr_buffer.numel()}")

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph

    @property
    def use_tensor_cores(self) -> bool:
        return self._tensor_cores is not None

    # ------------------------------------------------------------------ plan
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             data_type=None, sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, non_blocking: bool = True, block_tables=None, seq_lens=None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False, q_len_per_req: int = 1, *,
             window_right: int = 0, is_causal: bool | None = None, use_token_head_sf: bool = False) -> None:
        """Schedule a batch. indptr [batch+1] and last_page_len [batch] are int32 (host tensors keep
        plan() free of device syncs); indices holds the page ids (int32, on the workspace's device
        or the host). Positional order and meanings are FlashInfer 0.7.4's; data_type (deprecated)
        fills only the dtypes left None.
        fixed_split_size (pages) cuts every request into chunks of that size; under CUDA graphs the
        work-item capacity is static (max(batch, resident CTAs / CTAs per request)), and a fixed
        split that needs more work items is refused with the count it needs."""
        refuse_extras(block_tables=block_tables, seq_lens=seq_lens, window_right=window_right,
                      use_token_head_sf=use_token_head_sf)
        q_len_per_req = check_q_len(q_len_per_req, is_causal, self.use_tensor_cores)
        q_data_type, kv_data_type = resolve_data_type(q_data_type, kv_data_type, data_type)
        self._plan_from(DecodePlanInputs(
            indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode,
            window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, sm_scale, rope_scale, rope_theta,
            fixed_split_size, disable_split_kv, q_len_per_req))

    begin_forward = plan

    def _plan_from(self, inputs: DecodePlanInputs, host_indptr: torch.Tensor | None = None,
                   reuse: bool = False) -> None:
        """Plan from `inputs`. reuse (fast_decode_plan): keep the previous plan's checked knobs and
        module when only the page table changed, and under CUDA graphs read the page ids the caller
        wrote into paged_kv_indices_buffer instead of copying them there. host_indptr: a host copy
        of inputs.indptr (FlashInfer's global_override_indptr_cpu)."""
        self._plan_inputs, self._plan_call = inputs, (host_indptr, reuse)
        if self._tensor_cores is not None:
            self._plan_tensor_cores(inputs, host_indptr)
            return
        indptr = checks.host_int32(inputs.indptr if host_indptr is None else host_indptr, "indptr")
        batch_size = indptr.numel() - 1
        if batch_size < 1:
            raise ValueError(f"indptr: expected at least 2 entries (batch_size + 1), got {indptr.numel()}")
        knobs = self._knobs if reuse and self._knobs is not None and self._knobs.key == inputs.knobs_key() else None
        if knobs is None:
            knobs = check_knobs(inputs)
        # A request's kv tokens, (pages - 1) * page_size + last_page_len, are int32 in the planner and kernels.
        checks.times_longest(knobs.page_size, "page_size", indptr, "pages", "kv tokens")
        if reuse and knobs.page_size == 1:  # every last page holds its one token: no device read needed
            last_page_len = torch.ones(batch_size, dtype=torch.int32)
        else:
            last_page_len = checks.host_int32(inputs.last_page_len, "last_page_len", batch_size)
        kv_cache.check_page_ids(inputs.indices, "indices")
        if self._graph and self._graph_batch_size not in (None, batch_size):
            raise ValueError(f"indptr: this CUDA-graph wrapper was planned for batch_size={self._graph_batch_size}, "
                             f"got {batch_size}; a captured graph has a fixed batch size")
        device_index = cuda_index(self._device)
        module = (self._plan.module if knobs is self._knobs and self._plan is not None else
                  _decode_module(self._backend, knobs.dtype_q, knobs.dtype_kv, knobs.dtype_o, knobs.head_dim,
                                 knobs.pos_encoding, knobs.window_left >= 0, knobs.soft_cap > 0, device_index))
        self._knobs = knobs
        indices, host_max_page = self._stage_indices(inputs, indptr, last_page_len, reuse)
        self._schedule(knobs, module, indptr, last_page_len, indices, host_max_page, device_index)

    def _stage_indices(self, inputs: DecodePlanInputs, indptr: torch.Tensor, last_page_len: torch.Tensor,
                       reuse: bool) -> tuple[torch.Tensor, int | None]:
        """The page ids the kernel reads, on the device. Under CUDA graphs plan() also fills the
        caller's indptr and last_page_len buffers, as FlashInfer's does; a re-plan (reuse) trusts
        the caller to have written all three, as FlashInfer's fast_decode_plan does."""
        indices = inputs.indices
        if self._graph and reuse:
            if indices.numel() > self._graph_indices.numel():
                raise ValueError(f"paged_kv_indices_buffer: holds {self._graph_indices.numel()} page ids, the plan "
                                 f"needs {indices.numel()}")
            return self._graph_indices, None
        if self._graph:
            for buffer, values in ((self._paged_kv_indptr_buf, inputs.indptr),
                                   (self._paged_kv_last_page_len_buf, inputs.last_page_len)):
                if buffer is not None and buffer.data_ptr() != values.data_ptr():
                    buffer[: values.numel()].copy_(values, non_blocking=True)
        return kv_cache.stage_page_ids(indices, int(indptr[-1]) if not indices.is_cuda else 0, self._device,
                                       "indices", self._graph_indices, "paged_kv_indices_buffer")

    def _plan_tensor_cores(self, inputs: DecodePlanInputs, host_indptr: torch.Tensor | None) -> None:
        """Plan the prefill kernels: q_len_per_req query rows per request, causal among them (the last
        row sees every key, as FlashInfer's bottom-right alignment has it)."""
        indptr = checks.host_int32(inputs.indptr if host_indptr is None else host_indptr, "indptr")
        q_len = inputs.q_len_per_req
        # qo_indptr below is int32: the batch's query tokens must fit.
        checks.int32_times(q_len, "q_len_per_req", indptr.numel() - 1, f"times batch_size={indptr.numel() - 1}, "
                           "the batch's query tokens (qo_indptr)")
        if self._graph:
            if self._graph_q_len not in (None, q_len):
                raise ValueError(f"q_len_per_req: this CUDA-graph wrapper was planned with {self._graph_q_len}, got "
                                 f"{q_len}; it is part of the captured shape, so use one wrapper per q_len_per_req")
            self._graph_q_len = q_len
        if q_len > 1:
            check_kv_covers_queries(indptr, inputs.last_page_len, inputs.page_size, q_len)
        qo_indptr = torch.arange(indptr.numel(), dtype=torch.int32) * q_len
        if self._qo_indptr_buf is not None:
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=True)
        self._tensor_cores._decode_plans = q_len == 1
        self._tensor_cores.plan(
            qo_indptr, indptr, inputs.indices, inputs.last_page_len,
            inputs.num_qo_heads, inputs.num_kv_heads, inputs.head_dim, inputs.page_size, causal=q_len > 1,
            pos_encoding_mode=inputs.pos_encoding_mode, window_left=inputs.window_left,
            logits_soft_cap=inputs.logits_soft_cap, sm_scale=inputs.sm_scale, rope_scale=inputs.rope_scale,
            rope_theta=inputs.rope_theta, q_data_type=inputs.q_data_type, kv_data_type=inputs.kv_data_type,
            o_data_type=inputs.o_data_type, fixed_split_size=inputs.fixed_split_size,
            disable_split_kv=inputs.disable_split_kv)

    def _schedule(self, knobs: DecodeKnobs, module: Module, indptr: torch.Tensor, last_page_len: torch.Tensor,
                  indices: torch.Tensor, host_max_page: int | None, device_index: int) -> None:
        """Run the module's C++ planner over the host page table, upload the plan image and build
        the launch parameters run() patches."""
        batch_size, num_qo_heads, num_kv_heads = indptr.numel() - 1, knobs.num_qo_heads, knobs.num_kv_heads
        head_dim, page_size, window_left = knobs.head_dim, knobs.page_size, knobs.window_left
        heads, tiles = heads_per_cta(num_qo_heads // num_kv_heads)
        ctas_per_request = num_kv_heads * tiles
        max_ctas = _max_ctas(module, heads, device_index)
        fixed_tokens = split_tokens(knobs.fixed_split_size, page_size)
        capacity = work_capacity(batch_size, max_ctas, ctas_per_request)
        if fixed_tokens and not self._graph:
            capacity = max(capacity, batch_size + -(-int(indptr[-1]) * page_size // fixed_tokens))
        if self._graph:
            self._graph_batch_size = batch_size
        image_size = checks.plan_image_size(_layout(batch_size, capacity, ctas_per_request)[1], capacity)
        host_image = self._image.host_buffer(image_size)  # grows the device image too
        image_ptr, device_image_ptr = host_image.data_ptr(), self._image.on_device.data_ptr()

        binding = module.binding
        args_template, params_template = _struct_templates(
            module, batch_size, num_qo_heads, num_kv_heads, page_size, window_left, fixed_tokens,
            knobs.disable_split_kv, capacity, max_ctas, device_index, self._debug)
        args = binding.DecodePlanArgs.from_buffer_copy(args_template)
        args.indptr, args.last_page_len, args.image = indptr.data_ptr(), last_page_len.data_ptr(), image_ptr
        args.device_image, args.upload_stream = device_image_ptr, current_stream(device_index)
        args.upload_done = self._image.staging.upload_done.cuda_event
        args.num_indices = indices.numel()
        info = binding.DecodePlanInfo()
        status = module.fns["decode_plan"](ctypes.byref(args), ctypes.byref(info))
        if status != 0:
            raise ValueError(f"plan(): {module.last_error()}")

        partials = capacity if self._graph else info.num_partials
        v_bytes, s_bytes = partial_bytes(partials, num_qo_heads, head_dim)
        available = self._workspace.numel() * self._workspace.element_size()
        if v_bytes + s_bytes > available:
            raise ValueError(
                f"float_workspace_buffer: this plan needs {v_bytes + s_bytes} bytes for split-KV partials, the buffer "
                f"has {available}; allocate at least attnforge.decode_workspace_size({batch_size}, {num_qo_heads}, "
                f"{num_kv_heads}, {head_dim}) bytes")
        module.check(module.fns["decode_upload"](ctypes.byref(args)), "plan image upload")

        workspace_ptr = self._workspace.data_ptr()
        params = binding.DecodeParams.from_buffer_copy(params_template)
        params.indices, params.plan = indices.data_ptr(), device_image_ptr
        params.tmp_v, params.tmp_s = workspace_ptr, workspace_ptr + v_bytes
        params.work_capacity = capacity if self._graph else info.num_work
        params.rope_rcp_scale, params.rope_rcp_theta = 1.0 / knobs.rope_scale, 1.0 / knobs.rope_theta
        self._plan = _Plan(
            module=module, params=params, batch_size=batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, dtype_q=dispatch.torch_dtype(knobs.dtype_q),
            dtype_kv=dispatch.torch_dtype(knobs.dtype_kv), dtype_o=dispatch.torch_dtype(knobs.dtype_o),
            sm_scale=knobs.sm_scale, soft_cap=knobs.soft_cap, window_left=window_left, host_max_page=host_max_page,
            indices=indices)
        self._set_scales(1.0, 1.0)

    def _set_scales(self, q_scale: float, k_scale: float) -> None:
        plan = self._plan
        plan.params.score_scale, plan.params.post_scale = score_scales(plan.sm_scale * q_scale * k_scale, plan.soft_cap)
        plan.scales = (q_scale, k_scale)

    # ------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            enable_pdl: bool | None = None, window_left: int | None = None, sinks=None, q_len_per_req: int | None = None,
            skip_softmax_threshold_scale_factor: float | None = None, kv_cache_sf=None):
        """Attention of q [batch, num_qo_heads, head_dim] over the planned pages of paged_kv_cache.
        Returns o (planned o dtype), or (o, lse) with lse [batch, num_qo_heads] fp32 base 2.
        sinks: None, or gpt-oss attention sinks, a float32 tensor [num_qo_heads] on the device: one
        logit per query head, in the units of the scaled scores s_j (natural log, not multiplied by
        sm_scale), added to the softmax denominator as a key with no value:
        o = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)); lse includes it,
        lse = log2(2^(sink*log2(e)) + sum_j 2^(s_j*log2(e))).
        enable_pdl: launch with programmatic dependent launch (None: where the device is sm90+;
        True on an older device is off, as in FlashInfer)."""
        if skip_softmax_threshold_scale_factor is not None or kv_cache_sf is not None:
            refuse_run_extras(skip_softmax_threshold_scale_factor, kv_cache_sf)
        if q_len_per_req is not None:
            self._check_run_q_len(q_len_per_req)
        if is_compiling():
            return compile_ops.batch_run("batch_decode", self, self._planned_o_dtype(), q, paged_kv_cache, args,
                                         q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left,
                                         sinks)
        if self._tensor_cores is not None:
            return self._tensor_cores.run(q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                          out=out, lse=lse, return_lse=return_lse, enable_pdl=enable_pdl,
                                          window_left=window_left, sinks=sinks)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan(): call plan() with the batch's page table first")
        if args or q_scale is not None or k_scale is not None or v_scale is not None:
            # rule fa2-no-fp8-q: a CUDA-core decode query is 16-bit; FlashInfer ignores extra positional arguments then.
            q_scale, k_scale, v_scale = checks.positional_scales(args, False, q_scale, k_scale, v_scale)
            q_scale, k_scale = checks.scale(q_scale, "q_scale"), checks.scale(k_scale, "k_scale")
            v_scale = checks.scale(v_scale, "v_scale")
        if enable_pdl is not None or window_left is not None:
            checks.run_extras(plan.window_left, enable_pdl, window_left)
        accepted = plan.accepted
        accepted.ensure(q, "q", self._check_q)
        cache = accepted.paged(paged_kv_cache, self._check_cache)
        if plan.host_max_page is not None and plan.host_max_page >= cache.num_pages:
            raise ValueError(f"indices: page id {plan.host_max_page} is out of range for a cache of "
                             f"{cache.num_pages} pages")
        if out is None:
            out = torch.empty(q.shape, dtype=plan.dtype_o, device=self._device)
        else:
            accepted.ensure(out, "out",
                            lambda out: output(out, "out", q.shape, plan.dtype_o, self._device, "same as q"))
        if return_lse:
            lse = lse_output(lse, q.shape[:2], self._device, "[batch_size, num_qo_heads]")
        scales = (q_scale or 1.0, k_scale or 1.0)
        if scales != plan.scales:
            self._set_scales(*scales)
        params = plan.params
        params.q, params.k, params.v = q.data_ptr(), cache.k_ptr, cache.v_ptr
        params.o, params.lse = out.data_ptr(), lse.data_ptr() if return_lse else None
        params.sinks = accepted.sinks_ptr(sinks, plan.num_qo_heads, self._device)
        params.q_stride_n, params.q_stride_h = q.stride(0), q.stride(1)
        params.o_stride_n, params.o_stride_h = out.stride(0), out.stride(1)
        params.num_pages = cache.num_pages
        params.kv_stride_page, params.kv_stride_token, params.kv_stride_head = cache.strides
        params.enable_pdl = dispatch.pdl_flag(enable_pdl, self._device_index)
        plan.module.check(plan.module.fns["decode_run"](ctypes.byref(params), current_stream(self._device_index)),
                          "decode run")
        if params.debug_sync and not torch.cuda.is_current_stream_capturing():  # a captured run has not run yet
            self._raise_kernel_errors()
        if v_scale is not None and v_scale != 1.0:
            out.mul_(v_scale)
        return (out, lse) if return_lse else out

    def _check_q(self, q) -> None:
        plan = self._plan
        checks.planned_tensor(q, "q", (plan.batch_size, plan.num_qo_heads, plan.head_dim),
                              "[batch_size, num_qo_heads, head_dim]", planned_dtype=plan.dtype_q,
                              dtype_arg="q_data_type", on=self._device)

    def _check_cache(self, paged_kv_cache):
        plan = self._plan
        return checked_paged(paged_kv_cache, self._kv_layout, plan.page_size, plan.num_kv_heads, plan.head_dim,
                             plan.head_dim, plan.dtype_kv, self._device)

    def _check_run_q_len(self, q_len_per_req) -> None:
        """run()'s q_len_per_req (FlashInfer's deprecated place for it) must be what plan() was given."""
        planned = self._plan_inputs.q_len_per_req if self._plan_inputs is not None else 1
        if q_len_per_req != planned:
            raise ValueError(f"q_len_per_req: plan() was given {planned}, run() {q_len_per_req!r}; pass it to plan() "
                             "(q holds batch_size * q_len_per_req rows)")

    def _planned_o_dtype(self) -> torch.dtype:
        """The output dtype plan() chose (read while torch.compile traces run())."""
        plan = (self._tensor_cores if self._tensor_cores is not None else self)._plan
        if plan is None:
            raise RuntimeError("run() called before plan(): call plan() with the batch's page table first")
        return plan.dtype_o

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def forward(self, q: torch.Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None, k_scale=None,
                v_scale=None, window_left: int = -1, logits_soft_cap: float | None = None,
                sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None):
        """Deprecated (FlashInfer's): run() with these knobs replacing plan()'s (see call_knobs)."""
        self._apply_call_knobs(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                               rope_theta=rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q: torch.Tensor, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None,
                           k_scale=None, v_scale=None, window_left: int = -1, logits_soft_cap: float | None = None,
                           sm_scale: float | None = None, rope_scale: float | None = None,
                           rope_theta: float | None = None):
        """Deprecated (FlashInfer's): run_return_lse() with these knobs replacing plan()'s."""
        self._apply_call_knobs(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                               rope_theta=rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)

    def _apply_call_knobs(self, **given_raw) -> None:
        """Make the plan carry forward()'s knobs: scalars in place, anything else by planning again
        from the last plan's page table."""
        inputs = self._plan_inputs
        if inputs is None:
            raise RuntimeError("forward() called before plan(): call plan() (or begin_forward()) first")
        head_dim = inputs.head_dim
        given = call_knobs.normalized(head_dim, **given_raw)
        planned = call_knobs.normalized(head_dim, pos_encoding_mode=inputs.pos_encoding_mode,
                                        window_left=inputs.window_left, logits_soft_cap=inputs.logits_soft_cap,
                                        sm_scale=inputs.sm_scale, rope_scale=inputs.rope_scale,
                                        rope_theta=inputs.rope_theta)
        names = call_knobs.changed(given, planned)
        if not names:
            return
        if call_knobs.needs_new_plan(names, given, planned):
            host_indptr, reuse = self._plan_call
            self._plan_from(dataclasses.replace(inputs, **given_raw), host_indptr, reuse)
            return
        plan = self._tensor_cores._plan if self._tensor_cores is not None else self._plan
        plan.sm_scale, plan.soft_cap = given["sm_scale"], given["soft_cap"]
        if self._tensor_cores is None:
            self._set_scales(*plan.scales)  # run() folds them in only when the call's scales change
        else:
            plan.scales = None

    def _raise_kernel_errors(self) -> None:
        error = self._image.read_slot(PLAN_HEADER.index("error"))
        if error & PLAN_ERROR_BAD_PAGE:
            raise RuntimeError(f"{self._plan.module.spec.uri}: fa2::decode_kernel read a page id outside [0, "
                               f"{self._plan.params.num_pages}) from indices; the affected outputs are NaN")

    def end_forward(self) -> None:
        """FlashInfer compatibility: nothing to release."""


def __getattr__(name: str):
    # FlashInfer's decode module also holds the CUDA-graph wrapper, fast_decode_plan and
    # single_decode_with_kv_cache; they live in modules that import this one, so they are reached lazily.
    if name in ("CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan"):
        from . import decode_graph

        return getattr(decode_graph, name)
    if name == "single_decode_with_kv_cache":
        from . import decode_single

        return decode_single.single_decode_with_kv_cache
    raise AttributeError(f"module 'attnforge.decode' has no attribute {name!r}")
