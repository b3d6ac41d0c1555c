"""The steps of the batch-prefill wrappers' plan(), each a plain function, in the order plan() runs them:

    check_request    validate the batch description (host index arrays, heads, head dims, page size)
    check_options    validate the kernel options (masks, scales, window, soft cap, dtypes, split)
    check_bounds     int32 bounds that need the batch and the options together
    resolve_module   the kernel spec they select, its module built on first use
    schedule         size the plan image and run the module's C++ planner into its host buffer
    stage_mask       the custom mask bit-packed on the device, its byte offsets in the image
    carve_workspace  the float workspace: split-KV partials, then fa3's gathered pages and V^T
    build_params     the PrefillParams run() patches its pointers into

The wrapper (prefill.py) holds what outlives one plan (plan image buffers, the CUDA-graph shape)
and calls them; nothing here keeps state or waits for the GPU. Each record is built by one step and
only read after it. The records are not frozen: a frozen dataclass sets every field through
object.__setattr__, which added about 17% to plan()'s host instructions.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from attnforge.codegen.dtypes import DType
from attnforge.codegen.fa3_units import fa3_cta_tile
from attnforge.codegen.kv_tiles import prefill_cta_tiles, prefill_kv_tile
from attnforge.codegen.spec import Backend, PosEncoding

from . import call_knobs, checks, dispatch, kv_cache
from .loader import Module, load
from .mask import segment_packbits
from .plan_buffers import PlanImage, num_sms, split_tokens
from .planner import MIN_CHUNK_TOKENS
from .prefill_ahead import GATHER_MAX_BYTES, VT_BLOCK_KEYS, gathered_kv_bytes, gathered_rows, gathers_pages, transposed_v_blocks
from .prefill_planner import (
    PrefillPlanLayout,
    cta_tile_q,
    packed_len_estimate,
    prefill_partial_capacity,
    prefill_work_capacity,
)


@dataclass(slots=True)
class PlanRequest:
    """The batch plan() was given, checked: host int32 index arrays and the attention's shape."""

    paged: bool
    qo_indptr: torch.Tensor  # [batch+1] query tokens
    kv_indptr: torch.Tensor  # [batch+1] pages (paged) or tokens (ragged)
    indices: torch.Tensor | None  # paged: the page ids as given (host or device)
    last_page_len: torch.Tensor | None  # paged: [batch]
    batch_size: int
    total_q: int  # qo_indptr[-1]
    total_kv: int  # kv_indptr[-1]
    num_qo_heads: int
    num_kv_heads: int
    group: int  # num_qo_heads // num_kv_heads
    head_dim_qk: int
    head_dim_vo: int
    page_size: int  # 1 when ragged


@dataclass(slots=True)
class KernelOptions:
    """plan()'s kernel options, checked: what selects the module and what its params carry."""

    dtype_q: DType
    dtype_kv: DType
    dtype_o: DType
    pos_encoding: PosEncoding
    causal: bool
    window_left: int  # -1: no sliding window
    soft_cap: float  # 0.0: none
    sm_scale: float
    rope_scale: float
    rope_theta: float
    use_custom_mask: bool
    custom_mask: torch.Tensor | None  # booleans, or
    packed_custom_mask: torch.Tensor | None  # the same bit-packed (little bit order); at most one is given
    fixed_split_size: int | None  # pages; None or -1: automatic
    disable_split_kv: bool


def check_request(*, paged: bool, qo_indptr, kv_indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                  head_dim_qk, head_dim_vo, page_size) -> PlanRequest:
    """Validate the batch description; index arrays come back as contiguous host int32 tensors."""
    qo_indptr = checks.host_int32(qo_indptr, "qo_indptr")
    batch_size = qo_indptr.numel() - 1
    if batch_size < 1:
        raise ValueError(f"qo_indptr: expected at least 2 entries (batch_size + 1), got {qo_indptr.numel()}")
    kv_indptr = checks.host_int32(kv_indptr, "paged_kv_indptr" if paged else "kv_indptr", batch_size + 1)
    if paged:
        kv_cache.check_page_ids(indices, "paged_kv_indices")
    num_qo_heads, num_kv_heads = checks.heads(num_qo_heads, num_kv_heads)
    head_dim_qk = checks.positive_int(head_dim_qk, "head_dim_qk")
    head_dim_vo = head_dim_qk if head_dim_vo is None else checks.positive_int(head_dim_vo, "head_dim_vo")
    page_size = checks.positive_int(page_size, "page_size")
    if paged:
        last_page_len = checks.host_int32(last_page_len, "paged_kv_last_page_len", batch_size)
        # A request's kv tokens, (pages - 1) * page_size + last_page_len, are int32 in the plan image and kernels.
        checks.times_longest(page_size, "page_size", kv_indptr, "pages", "kv tokens")
    # The kernels fold the GQA group into the query rows: qo_len * group packed rows, int32 in the kernels.
    checks.times_longest(num_qo_heads // num_kv_heads, "num_qo_heads / num_kv_heads", qo_indptr, "query tokens",
                         "packed query rows")
    return PlanRequest(paged, qo_indptr, kv_indptr, indices, last_page_len, batch_size, int(qo_indptr[-1]),
                       int(kv_indptr[-1]), num_qo_heads, num_kv_heads, num_qo_heads // num_kv_heads, head_dim_qk,
                       head_dim_vo, page_size)


def check_options(*, head_dim_qk: int, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                  use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type,
                  kv_data_type, o_data_type, fixed_split_size, disable_split_kv) -> KernelOptions:
    """Validate the kernel options; sm_scale defaults to 1 / sqrt(head_dim_qk); a custom mask makes
    causal irrelevant (options.causal is then False)."""
    knobs = call_knobs.normalized(head_dim_qk, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                                  rope_theta=rope_theta)
    checks.split_size(fixed_split_size)
    if custom_mask is not None and packed_custom_mask is not None:
        raise ValueError("custom_mask, packed_custom_mask: pass one of them, not both")
    use_custom_mask = custom_mask is not None or packed_custom_mask is not None
    # FlashInfer: causal applies only without a custom mask; with one, the mask alone decides.
    causal = bool(causal) and not use_custom_mask
    if use_fp16_qk_reduction:
        raise ValueError("use_fp16_qk_reduction: the prefill kernels accumulate q.k in fp32; pass False")
    dtype_q, dtype_kv, dtype_o = dispatch.planned_dtypes(q_data_type, kv_data_type, o_data_type)
    return KernelOptions(dtype_q=dtype_q, dtype_kv=dtype_kv, dtype_o=dtype_o, causal=causal, **knobs,
                         use_custom_mask=use_custom_mask, custom_mask=custom_mask,
                         packed_custom_mask=packed_custom_mask, fixed_split_size=fixed_split_size,
                         disable_split_kv=bool(disable_split_kv))


def check_bounds(request: PlanRequest, options: KernelOptions) -> None:
    """Bounds that need the batch and the options together: a chunk's kv tokens (fixed_split_size
    times page_size) and the window's lower edge, a query position (down to minus the request's
    query tokens, for causal prompts longer than their kv) minus window_left, are int32 in the
    kernels. O(1) unless the window is within a batch's query tokens of INT32_MAX."""
    checks.split_size(options.fixed_split_size, request.page_size)
    if options.window_left > checks.INT32_MAX - request.total_q:
        longest = int(request.qo_indptr.diff().max())
        checks.int_in(options.window_left, "window_left", -1, checks.INT32_MAX - longest,
                      f"-1: no window; the kernels subtract it from query positions down to -{longest} in int32")


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


def resolve_module(backend: str, request: PlanRequest, options: KernelOptions, device_index: int) -> Module:
    """The module of the spec the request and options select (cached per process; built on first use)."""
    return _prefill_module(backend, options.dtype_q, options.dtype_kv, options.dtype_o, request.head_dim_qk,
                           request.head_dim_vo, options.pos_encoding, options.window_left >= 0, options.soft_cap > 0,
                           options.use_custom_mask, device_index)


@functools.cache
def _max_ctas(module: Module, tile: int, paged: bool, device_index: int) -> int:
    ctas_per_sm = ctypes.c_int32()
    module.check(module.fns["prefill_occupancy"](tile, int(paged), device_index, ctypes.byref(ctas_per_sm)),
                 "prefill occupancy query")
    return num_sms(device_index) * max(ctas_per_sm.value, 1)


@dataclass(slots=True)
class Schedule:
    """What the C++ planner wrote into the host plan image, and the sizes it was given."""

    image: torch.Tensor  # pinned host int32 image; its run-only arrays are filled by the later steps
    image_size: int
    offsets: dict[str, int]  # off_* of every image array (the params carry them all)
    tile: int  # packed q rows per CTA
    max_ctas: int
    capacity: int  # work items the image has room for
    rows: int  # query rows the merge covers
    num_work: int
    num_partials: int
    may_gather: bool  # fa3 paged: the image has room for gathered_kv_indptr
    may_transpose_v: bool  # fa3 fp8: the image has room for vt_block


def schedule(module: Module, request: PlanRequest, options: KernelOptions, rows: int, num_indices: int,
             plan_image: PlanImage, graph: bool, device_index: int) -> Schedule:
    """Size the plan image for `rows` query rows and run the module's C++ planner into its host
    buffer: (request, q tile, kv chunk) work items, chunk counts and the merge's indptr.
    num_indices: page ids staged (paged) or kv tokens (ragged), what kv_indptr may reach."""
    batch_size, group, page_size = request.batch_size, request.group, request.page_size
    fixed_tile = fa3_cta_tile(module.spec) if module.spec.backend is Backend.FA3 else 0
    max_tile = prefill_cta_tiles(module.spec)[-1]
    tile = fixed_tile or cta_tile_q(packed_len_estimate(rows, batch_size, group, graph), max_tile)
    max_ctas = _max_ctas(module, tile, request.paged, device_index)
    fixed_tokens = split_tokens(options.fixed_split_size, page_size)
    capacity = prefill_work_capacity(rows, batch_size, group, tile, max_ctas, request.num_kv_heads)
    if fixed_tokens and not graph:  # every q tile may be cut into that many chunks
        capacity = max(capacity, capacity * -(-request.total_kv * page_size // fixed_tokens))
    layout = PrefillPlanLayout(batch_size, capacity, rows)
    planner_offsets = layout.offsets()
    # After the planner's arrays, three only run() reads: the custom mask's per-request byte offsets,
    # then, as fa3 may gather its pages and (fp8) transpose V ahead (not under CUDA graphs, whose
    # replays keep the kernels they captured), each request's first gathered row and first V^T block.
    fa3_ahead = module.spec.backend is Backend.FA3 and not graph
    may_gather = fa3_ahead and request.paged
    may_transpose_v = fa3_ahead and module.spec.dtype_kv.is_fp8
    off_mask_indptr = layout.size
    off_gathered_kv_indptr = off_mask_indptr + (batch_size + 1 if options.use_custom_mask else 0)
    off_vt_block = off_gathered_kv_indptr + (batch_size + 1 if may_gather else 0)
    image_size = checks.plan_image_size(off_vt_block + (batch_size + 1 if may_transpose_v else 0), capacity)
    image = plan_image.host_buffer(image_size)

    binding = module.binding
    # Chunks align to the paged variant's kv tile even where fa3 later gathers the pages and runs
    # its ragged variant: the tiles differ only at 16-bit head dims over 160 (64 vs 80 keys).
    args = binding.PrefillPlanArgs(
        qo_indptr=request.qo_indptr.data_ptr(), kv_indptr=request.kv_indptr.data_ptr(),
        last_page_len=request.last_page_len.data_ptr() if request.paged else None, image=image.data_ptr(),
        batch_size=batch_size, paged=int(request.paged), page_size=page_size, num_indices=num_indices,
        num_kv_heads=request.num_kv_heads, group_size=group, max_cta_tile_q=max_tile,
        fixed_cta_tile_q=fixed_tile, max_ctas=max_ctas, causal=int(options.causal), window_left=options.window_left,
        fixed_split_tokens=fixed_tokens, disable_split_kv=int(options.disable_split_kv),
        min_chunk_tokens=MIN_CHUNK_TOKENS, chunk_align_tokens=prefill_kv_tile(module.spec, tile, request.paged),
        cuda_graph=int(graph), work_capacity=capacity, row_capacity=rows,
        **planner_offsets)
    info = binding.PrefillPlanInfo()
    if module.fns["prefill_plan"](ctypes.byref(args), ctypes.byref(info)) != 0:
        raise ValueError(f"plan(): {module.last_error()}")
    assert info.cta_tile_q == tile, "the planner and the wrapper must pick the same q tile"
    offsets = dict(planner_offsets, off_mask_indptr=off_mask_indptr, off_gathered_kv_indptr=off_gathered_kv_indptr,
                   off_vt_block=off_vt_block)
    return Schedule(image, image_size, offsets, tile, max_ctas, capacity, rows, info.num_work, info.num_partials,
                    may_gather, may_transpose_v)


def stage_mask(request: PlanRequest, options: KernelOptions, sched: Schedule, device: torch.device) -> torch.Tensor:
    """The bit-packed custom mask on the device; its per-request byte offsets go into the image."""
    batch_size, qo_indptr, image, offsets = request.batch_size, request.qo_indptr, sched.image, sched.offsets
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    kv_lens = image[offsets["off_kv_len"]: offsets["off_kv_len"] + batch_size].to(torch.int64)
    bits = qo_lens * kv_lens
    custom_mask, packed_custom_mask = options.custom_mask, options.packed_custom_mask
    # The image's mask_indptr holds each request's first byte as int32.
    checks.int_in(int(((bits + 7) // 8).sum()), "custom_mask" if custom_mask is not None else "packed_custom_mask",
                  0, checks.INT32_MAX, "bytes packed, sum(ceil(qo_len * kv_len / 8)); mask_indptr is int32 in the plan")
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
    image[offsets["off_mask_indptr"]: offsets["off_mask_indptr"] + batch_size + 1] = byte_indptr.to(torch.int32)
    return packed.to(device, non_blocking=True).contiguous()


@dataclass(slots=True)
class WorkspaceLayout:
    """Byte offsets in the float workspace: split-KV partial outputs at 0, their lse at v_bytes,
    then (1024-aligned) the pages gathered ahead, then V transposed ahead."""

    v_bytes: int
    gathered_offset: int
    gathered_pages: int  # 0: the kernel reads the pages
    vt_offset: int
    vt_blocks: int
    transposes_v: bool  # False: the kernel transposes V itself


def carve_workspace(request: PlanRequest, options: KernelOptions, sched: Schedule, workspace: torch.Tensor,
                    graph: bool) -> WorkspaceLayout:
    """Place the partials the plan may write in the float workspace, then, where it still has room,
    fa3's gathered pages and V^T (writing their per-request indptrs into the image)."""
    batch_size, group, image, offsets = request.batch_size, request.group, sched.image, sched.offsets
    slots = prefill_partial_capacity(sched.capacity, sched.tile, group) if graph else sched.num_partials
    v_bytes = -(-slots * request.num_qo_heads * request.head_dim_vo * 4 // 256) * 256
    s_bytes = slots * request.num_qo_heads * 4
    available = workspace.numel() * workspace.element_size()
    if v_bytes + s_bytes > available:
        raise ValueError(f"float_workspace_buffer: this plan needs {v_bytes + s_bytes} bytes for split-KV partials, "
                         f"the buffer has {available}; allocate at least that many (128 MiB covers typical batches)")
    ahead_offset = -(-(v_bytes + s_bytes) // 1024) * 1024
    gathered_pages = gathered_bytes = 0
    vt_first = None
    if sched.may_gather or sched.may_transpose_v:
        qo_lens = request.qo_indptr[1:] - request.qo_indptr[:-1]
        kv_lens = image[offsets["off_kv_len"]: offsets["off_kv_len"] + batch_size]
    if sched.may_gather and gathers_pages(qo_lens, kv_lens, group, options.causal, options.window_left):
        gathered_pages = request.total_kv - int(request.kv_indptr[0])
        gathered_bytes = gathered_kv_bytes(gathered_pages * request.page_size, request.num_kv_heads,
                                           request.head_dim_qk + request.head_dim_vo,
                                           dispatch.torch_dtype(options.dtype_kv).itemsize)
        if ahead_offset + gathered_bytes > min(available, GATHER_MAX_BYTES):
            gathered_pages, gathered_bytes = 0, 0
    if gathered_pages:
        image[offsets["off_gathered_kv_indptr"]: offsets["off_gathered_kv_indptr"] + batch_size + 1] = \
            gathered_rows(request.kv_indptr, request.page_size)
    vt_offset = ahead_offset + gathered_bytes
    if sched.may_transpose_v:
        vt_first = transposed_v_blocks(qo_lens, kv_lens, group, sched.tile)
    vt_blocks = int(vt_first[-1]) if vt_first is not None else 0
    if vt_offset + request.num_kv_heads * vt_blocks * VT_BLOCK_KEYS * request.head_dim_vo > available:
        vt_first, vt_blocks = None, 0
    if vt_first is not None:
        image[offsets["off_vt_block"]: offsets["off_vt_block"] + batch_size + 1] = vt_first
    return WorkspaceLayout(v_bytes, ahead_offset, gathered_pages, vt_offset, vt_blocks, vt_first is not None)


def one_token_requests(qo_indptr: torch.Tensor) -> bool:
    """Whether no request of the (host) qo_indptr has more than one query token."""
    return int(qo_indptr.diff().max()) <= 1


def build_params(module: Module, request: PlanRequest, options: KernelOptions, sched: Schedule,
                 space: WorkspaceLayout, *, indices: torch.Tensor | None, mask: torch.Tensor | None, plan_ptr: int,
                 workspace_ptr: int, graph: bool, one_token: bool, debug: bool, device_index: int) -> ctypes.Structure:
    """The launch parameters, all but the tensors and scales run() patches in. plan_ptr: the
    device plan image; one_token: no request has more than one query token."""
    return module.binding.PrefillParams(
        indices=indices.data_ptr() if indices is not None else None,
        custom_mask=mask.data_ptr() if mask is not None else None, plan=plan_ptr, tmp_v=workspace_ptr,
        tmp_s=workspace_ptr + space.v_bytes,
        v_transposed=workspace_ptr + space.vt_offset if space.transposes_v else None, vt_blocks=space.vt_blocks,
        kv_gathered=workspace_ptr + space.gathered_offset if space.gathered_pages else None,
        gather_first_page=int(request.kv_indptr[0]) if space.gathered_pages else 0,
        gathered_pages=space.gathered_pages, batch_size=request.batch_size, num_qo_heads=request.num_qo_heads,
        num_kv_heads=request.num_kv_heads, group_size=request.group, page_size=request.page_size,
        work_capacity=sched.capacity if graph else sched.num_work, max_ctas=sched.max_ctas, row_capacity=sched.rows,
        causal=int(options.causal), window_left=options.window_left, cta_tile_q=sched.tile,
        paged=int(request.paged), run_merge=int(graph or sched.num_partials > 0), device=device_index,
        one_token_requests=int(one_token), debug_sync=int(debug), rope_rcp_scale=1.0 / options.rope_scale,
        rope_rcp_theta=1.0 / options.rope_theta, **sched.offsets)
