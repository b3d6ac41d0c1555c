"""The C ABI between a generated module and its Python binding.

The structs are declared once, here, as ordered field lists. The Jinja templates render the C++
structs from these lists and the Python binding renders its ctypes mirror from the same lists;
at load time the runtime compares the module's own sizeof/offsetof table with the mirror.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

# C type -> ctypes type name, for every C type the structs use.
CTYPES = {
    "void*": "c_void_p",
    "const void*": "c_void_p",
    "int64_t": "c_int64",
    "int32_t": "c_int32",
    "float": "c_float",
}


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str
    doc: str

    @property
    def ctypes_name(self) -> str:
        return CTYPES[self.ctype]


@dataclass(frozen=True)
class Struct:
    name: str
    doc: str
    fields: tuple[Field, ...]


def _struct(name: str, doc: str, *rows: tuple[str, str, str]) -> Struct:
    return Struct(name, doc, tuple(Field(*row) for row in rows))


# Slots at the head of the int32 plan image, before the per-request and per-work arrays.
PLAN_HEADER = ("num_work", "error", "num_partials", "job_counter")

# Where the per-request and per-work arrays sit in the plan image (int32 elements); the planner
# writes them there and the kernels read them back, so both structs carry the same offsets.
PLAN_OFFSETS = (
    ("off_indptr", "int32_t", "plan image offset of indptr[batch+1]"),
    ("off_work_request", "int32_t", "plan image offset of the work items' request ids"),
    ("off_work_begin", "int32_t", "plan image offset of the work items' first kv token"),
    ("off_work_end", "int32_t", "plan image offset of the work items' end kv token"),
    ("off_work_partial", "int32_t", "plan image offset of the work items' partial slot (-1: write o)"),
    ("off_partial_indptr", "int32_t", "plan image offset of the per-request partial slot ranges"),
    ("off_kv_len", "int32_t", "plan image offset of kv_len[batch] (the query of request r sits at kv_len[r] - 1)"),
    ("off_merge_counters", "int32_t", "plan image offset of the fused merge's arrival counters [batch, num_kv_heads, num_head_tiles], 0 between runs"),
)

DECODE_PARAMS = _struct(
    "DecodeParams",
    "Everything one batch-decode launch reads; built in plan(), tensor pointers patched in run().",
    ("q", "const void*", "[batch, num_qo_heads, head_dim] query"),
    ("k", "const void*", "paged K cache, element (page, head, token) at page*kv_stride_page + head*kv_stride_head + token*kv_stride_token"),
    ("v", "const void*", "paged V cache, same strides as k"),
    ("o", "void*", "[batch, num_qo_heads, head_dim] output (planned o dtype)"),
    ("lse", "void*", "[batch, num_qo_heads] fp32 base-2 log-sum-exp, or null"),
    ("indices", "const void*", "int32 page ids, request r owns indices[indptr[r]:indptr[r+1]]"),
    ("plan", "void*", "device int32 plan image written by plan()"),
    ("tmp_v", "void*", "fp32 partial outputs [num_partials, num_qo_heads, head_dim]"),
    ("tmp_s", "void*", "fp32 partial base-2 lse [num_partials, num_qo_heads]"),
    ("sinks", "const void*", "fp32 [num_qo_heads] attention sink logits (natural log, as the scaled scores), joined once per output row; null: none"),
    ("q_stride_n", "int64_t", "elements between requests in q"),
    ("q_stride_h", "int64_t", "elements between heads in q"),
    ("o_stride_n", "int64_t", "elements between requests in o"),
    ("o_stride_h", "int64_t", "elements between heads in o"),
    ("kv_stride_page", "int64_t", "elements between pages"),
    ("kv_stride_head", "int64_t", "elements between kv heads"),
    ("kv_stride_token", "int64_t", "elements between tokens of a page"),
    ("batch_size", "int32_t", "requests in the batch"),
    ("num_qo_heads", "int32_t", "query heads"),
    ("num_kv_heads", "int32_t", "kv heads"),
    ("group_size", "int32_t", "num_qo_heads / num_kv_heads"),
    ("heads_per_cta", "int32_t", "query heads one CTA serves (a compiled variant: 1, 2, 4 or 8)"),
    ("num_head_tiles", "int32_t", "ceil(group_size / heads_per_cta)"),
    ("page_size", "int32_t", "tokens per page"),
    ("num_pages", "int32_t", "pages in the cache; a page id outside [0, num_pages) is flagged"),
    ("work_capacity", "int32_t", "grid size in work items (static under CUDA graphs)"),
    *PLAN_OFFSETS,
    ("device", "int32_t", "CUDA device that holds the tensors"),
    ("debug_sync", "int32_t", "1: synchronize and check after every kernel"),
    ("enable_pdl", "int32_t", "1: programmatic dependent launch (sm90+): a kernel may start as the one before it ends"),
    ("score_scale", "float", "multiplies q.k: sm_scale*log2(e), or sm_scale/soft_cap with a soft cap"),
    ("post_scale", "float", "soft cap only: cap*log2(e), applied after tanh"),
    ("rope_rcp_scale", "float", "RoPE: 1 / rope_scale"),
    ("rope_rcp_theta", "float", "RoPE: 1 / rope_theta"),
)

DECODE_PLAN_ARGS = _struct(
    "DecodePlanArgs",
    "Host inputs of the decode planner, which writes the plan image in place, and where decode_upload copies it.",
    ("indptr", "const void*", "host int32 [batch+1] page indptr"),
    ("last_page_len", "const void*", "host int32 [batch] tokens in each request's last page"),
    ("image", "void*", "host int32 plan image to fill (pinned)"),
    ("device_image", "void*", "device int32 plan image the upload writes (its address is fixed under CUDA graphs)"),
    ("upload_stream", "void*", "cudaStream_t the upload is ordered on: the caller's current stream"),
    ("upload_done", "void*", "cudaEvent_t recorded after the upload; plan() waits on it before refilling the image"),
    ("batch_size", "int32_t", "requests"),
    ("page_size", "int32_t", "tokens per page"),
    ("num_indices", "int32_t", "entries in the page-id array"),
    ("ctas_per_request", "int32_t", "num_kv_heads * num_head_tiles: CTAs one work item launches"),
    ("max_ctas", "int32_t", "CTAs the GPU holds at once (SMs x occupancy)"),
    ("window_left", "int32_t", "sliding window (-1: none)"),
    ("fixed_split_tokens", "int32_t", "> 0: chunk every request into this many kv tokens"),
    ("disable_split_kv", "int32_t", "1: one work item per request"),
    ("min_chunk_tokens", "int32_t", "smallest chunk split-KV may cut"),
    ("chunk_align_tokens", "int32_t", "an automatic chunk is a multiple of this: the kernel's kv tile (<= 1: any)"),
    ("work_capacity", "int32_t", "room for work items (and partial slots) in the image"),
    ("image_size", "int32_t", "int32 entries of the plan image to upload"),
    ("device", "int32_t", "CUDA device that holds device_image"),
    *PLAN_OFFSETS,
)

DECODE_PLAN_INFO = _struct(
    "DecodePlanInfo",
    "What the planner decided.",
    ("num_work", "int32_t", "work items written"),
    ("num_partials", "int32_t", "fp32 partial slots the split requests need"),
    ("chunk_tokens", "int32_t", "kv tokens per chunk"),
    ("max_chunks", "int32_t", "largest number of chunks of one request"),
)

# The batch-prefill plan image's arrays (prefill contract, "Device-side plan image"); the prefill
# params struct carries the same offsets.
PREFILL_PLAN_OFFSETS = (
    ("off_qo_indptr", "int32_t", "plan image offset of qo_indptr[batch+1] (query token indptr)"),
    ("off_kv_indptr", "int32_t", "plan image offset of kv_indptr[batch+1] (paged: pages; ragged: tokens)"),
    ("off_kv_len", "int32_t", "plan image offset of kv_len[batch] (tokens)"),
    ("off_num_chunks", "int32_t", "plan image offset of num_chunks[batch] (kv chunks per request, 1: unsplit)"),
    ("off_work_request", "int32_t", "plan image offset of the work items' request ids"),
    ("off_work_qo_tile", "int32_t", "plan image offset of the work items' q tile (in packed rows / cta_tile_q)"),
    ("off_work_kv_begin", "int32_t", "plan image offset of the work items' first kv token"),
    ("off_work_kv_end", "int32_t", "plan image offset of the work items' end kv token"),
    ("off_work_partial", "int32_t", "plan image offset of the work items' first partial slot (-1: write o)"),
    ("off_merge_indptr", "int32_t", "plan image offset of merge_indptr[row_capacity+1] (partial slots per q row)"),
)

PREFILL_PLAN_ARGS = _struct(
    "PrefillPlanArgs",
    "Host inputs of the batch-prefill planner; it writes the plan image in place.",
    ("qo_indptr", "const void*", "host int32 [batch+1] query token indptr, starting at 0"),
    ("kv_indptr", "const void*", "host int32 [batch+1] page indptr (paged) or kv token indptr (ragged)"),
    ("last_page_len", "const void*", "host int32 [batch] tokens in each request's last page (paged only, else null)"),
    ("image", "void*", "host int32 plan image to fill (pinned)"),
    ("batch_size", "int32_t", "requests"),
    ("paged", "int32_t", "1: kv_indptr counts pages of page_size tokens; 0: it counts tokens"),
    ("page_size", "int32_t", "tokens per page (paged only)"),
    ("num_indices", "int32_t", "paged: entries in the page-id array; ragged: tokens in k and v"),
    ("num_kv_heads", "int32_t", "kv heads: CTAs one work item launches"),
    ("group_size", "int32_t", "num_qo_heads / num_kv_heads, folded into the q tile rows"),
    ("max_cta_tile_q", "int32_t", "the tallest fa2 q tile the module compiled (128, or 64: kv_tiles.prefill_cta_tiles)"),
    ("fixed_cta_tile_q", "int32_t", "> 0: packed q rows per CTA, fixed (an fa3 kernel has one tile); 0: choose"),
    ("max_ctas", "int32_t", "CTAs the GPU holds at once (SMs x occupancy)"),
    ("causal", "int32_t", "1: key j visible only up to the query's position"),
    ("window_left", "int32_t", "sliding window (-1: none)"),
    ("fixed_split_tokens", "int32_t", "> 0: chunk every request's kv range into this many tokens"),
    ("disable_split_kv", "int32_t", "1: one kv chunk per request"),
    ("min_chunk_tokens", "int32_t", "smallest chunk split-KV may cut"),
    ("chunk_align_tokens", "int32_t", "an automatic chunk is a multiple of this: the chosen variant's kv tile (<= 1: any)"),
    ("cuda_graph", "int32_t", "1: pick cta_tile_q from the static row_capacity, not from this batch"),
    ("work_capacity", "int32_t", "room for work items in the image"),
    ("row_capacity", "int32_t", "room for query rows in merge_indptr (static under CUDA graphs)"),
    *PREFILL_PLAN_OFFSETS,
)

PREFILL_PLAN_INFO = _struct(
    "PrefillPlanInfo",
    "What the batch-prefill planner decided.",
    ("num_work", "int32_t", "work items written"),
    ("num_partials", "int32_t", "fp32 partial slots the split requests need"),
    ("cta_tile_q", "int32_t", "packed q rows per CTA: fa2 16, 64 or 128, fa3 128 or 192 (the kernel variant to run)"),
    ("chunk_tokens", "int32_t", "kv tokens per chunk"),
    ("max_chunks", "int32_t", "largest number of chunks of one request"),
    ("causal_rows_without_keys", "int32_t", "causal only: query rows before their request's kv (o = 0, lse = -inf)"),
)

PREFILL_PARAMS = _struct(
    "PrefillParams",
    "Everything one batch-prefill launch reads; built in plan(), tensor pointers patched in run().",
    ("q", "const void*", "[total_q, num_qo_heads, head_dim_qk] query"),
    ("k", "const void*", "K: paged (page, head, token) strides as in decode, or ragged [total_kv, heads, dim]"),
    ("v", "const void*", "V, same strides as k"),
    ("o", "void*", "[total_q, num_qo_heads, head_dim_vo] output (planned o dtype)"),
    ("lse", "void*", "[total_q, num_qo_heads] fp32 base-2 log-sum-exp, or null"),
    ("indices", "const void*", "paged: int32 page ids, request r owns indices[kv_indptr[r]:kv_indptr[r+1]]"),
    ("custom_mask", "const void*", "uint8 bit-packed custom mask (little bit order), or null"),
    ("plan", "void*", "device int32 plan image written by plan()"),
    ("tmp_v", "void*", "fp32 partial outputs [slots, num_qo_heads, head_dim_vo]"),
    ("tmp_s", "void*", "fp32 partial base-2 lse [slots, num_qo_heads]"),
    ("q_scale", "const void*", "fa3 fp8: float32 q scales, per qo head or one for all (see q_scale_stride); null: 1"),
    ("k_scale", "const void*", "fa3 fp8: float32 k scales, per kv head or one for all; null: 1"),
    ("v_scale", "const void*", "fa3 fp8: float32 v scales, per kv head or one for all, applied to o; null: 1"),
    ("v_transposed", "void*", "fa3 fp8: workspace for V transposed ahead, [kv head][block][head_dim_vo][128 keys]; null: the kernel transposes"),
    ("sinks", "const void*", "fp32 [num_qo_heads] attention sink logits (natural log, as the scaled scores), joined once per output row; null: none"),
    ("kv_gathered", "void*", "fa3 paged: workspace for the plan's pages gathered ahead, K [rows, kv heads, head_dim_qk] then V [rows, kv heads, head_dim_vo]; null: the kernel reads the pages"),
    ("q_stride_n", "int64_t", "elements between query tokens"),
    ("q_stride_h", "int64_t", "elements between query heads"),
    ("o_stride_n", "int64_t", "elements between output tokens"),
    ("o_stride_h", "int64_t", "elements between output heads"),
    ("kv_stride_page", "int64_t", "K, paged: elements between pages (ragged: unused)"),
    ("kv_stride_head", "int64_t", "K: elements between kv heads"),
    ("kv_stride_token", "int64_t", "K: elements between kv tokens (of a page, or of the ragged tensor)"),
    ("v_stride_page", "int64_t", "V: as kv_stride_page (V may have its own head dim, so its own strides)"),
    ("v_stride_head", "int64_t", "V: as kv_stride_head"),
    ("v_stride_token", "int64_t", "V: as kv_stride_token"),
    ("batch_size", "int32_t", "requests in the batch"),
    ("num_qo_heads", "int32_t", "query heads"),
    ("num_kv_heads", "int32_t", "kv heads"),
    ("group_size", "int32_t", "num_qo_heads / num_kv_heads"),
    ("page_size", "int32_t", "tokens per page (1 when ragged)"),
    ("num_pages", "int32_t", "pages in the cache; a page id outside [0, num_pages) is flagged (ragged: kv rows)"),
    ("q_tokens", "int32_t", "rows of q (its first dim): what fa3's Q tensor map covers"),
    ("one_token_requests", "int32_t", "1: no request of the plan has more than one query token (fa3 fp8: its decode kernels may run)"),
    ("work_capacity", "int32_t", "work items the plan holds (static under CUDA graphs): the grid covers them"),
    ("max_ctas", "int32_t", "CTAs the device runs at once (SMs x CTAs per SM): fa3's persistent grid"),
    ("row_capacity", "int32_t", "rows the merge kernel covers (static under CUDA graphs)"),
    ("causal", "int32_t", "1: key j is visible to query position p only if j <= p (bottom-right aligned)"),
    ("window_left", "int32_t", "sliding window (-1: none)"),
    ("cta_tile_q", "int32_t", "packed query rows per CTA: the compiled variant that runs (fa2 16, 64, 128; fa3 128, 192)"),
    ("paged", "int32_t", "1: paged KV (indices); 0: ragged KV"),
    *PREFILL_PLAN_OFFSETS,
    ("off_mask_indptr", "int32_t", "plan image offset of mask_indptr[batch+1] (bytes of the packed custom mask)"),
    ("off_vt_block", "int32_t", "V transposed ahead: plan image offset of vt_block[batch+1] (each request's first block)"),
    ("vt_blocks", "int32_t", "V transposed ahead: blocks of 128 keys per kv head (vt_block[batch])"),
    ("off_gathered_kv_indptr", "int32_t", "pages gathered ahead: plan image offset of each request's first gathered row [batch+1]"),
    ("gather_first_page", "int32_t", "pages gathered ahead: index of the first one in indices (kv_indptr[0])"),
    ("gathered_pages", "int32_t", "pages gathered ahead (kv_indptr[batch] - kv_indptr[0]); their rows: times page_size"),
    ("run_merge", "int32_t", "1 when some request is split and the merge kernel must run"),
    ("device", "int32_t", "CUDA device that holds the tensors"),
    ("debug_sync", "int32_t", "1: synchronize and check after every kernel"),
    ("enable_pdl", "int32_t", "1: programmatic dependent launch (sm90+): a kernel may start as the one before it ends"),
    ("q_scale_stride", "int32_t", "1: q_scale[head]; 0: q_scale[0] for every head"),
    ("k_scale_stride", "int32_t", "1: k_scale[kv head]; 0: k_scale[0] for every head"),
    ("v_scale_stride", "int32_t", "1: v_scale[kv head]; 0: v_scale[0] for every head"),
    ("sm_scale_log2", "float", "multiplies q.k: sm_scale*log2(e), or sm_scale/soft_cap with a soft cap"),
    ("soft_cap_log2", "float", "soft cap only: cap*log2(e), applied after tanh"),
    ("rope_rcp_scale", "float", "RoPE: 1 / rope_scale"),
    ("rope_rcp_theta", "float", "RoPE: 1 / rope_theta"),
)

DECODE_STRUCTS = (DECODE_PARAMS, DECODE_PLAN_ARGS, DECODE_PLAN_INFO)
PREFILL_STRUCTS = (PREFILL_PARAMS, PREFILL_PLAN_ARGS, PREFILL_PLAN_INFO)


# Error bits a kernel may raise in the plan image's "error" slot.
PLAN_ERROR_BAD_PAGE = 1


def expected_abi_table(mirrors, structs: tuple[Struct, ...]) -> list[int]:
    """The table a module's `<uri>_abi()` must report, computed from ctypes mirrors (a binding's
    STRUCTS) of the canonical `structs` of its kind: per canonical struct its sizeof, then the offset of each canonical field looked up
    BY NAME in the mirror (so a mirror with reordered fields disagrees); then the plan-image
    header constants."""
    by_name = {mirror.__name__: mirror for mirror in mirrors}
    table: list[int] = []
    for struct in structs:
        mirror = by_name.get(struct.name)
        if mirror is None:
            raise ValueError(f"the binding has no ctypes mirror of {struct.name}")
        table.append(ctypes.sizeof(mirror))
        for field in struct.fields:
            table.append(getattr(getattr(mirror, field.name, None), "offset", -1))
    table.extend(
        [PLAN_HEADER.index("num_work"), PLAN_HEADER.index("error"), PLAN_HEADER.index("num_partials"), len(PLAN_HEADER), PLAN_ERROR_BAD_PAGE]
    )
    return table

