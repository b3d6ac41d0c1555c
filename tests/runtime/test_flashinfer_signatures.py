"""attnforge's public signatures against FlashInfer 0.7.4's (CPU): the same names at the same module
paths, the same positional order and the same keyword names, so code written for FlashInfer binds
every argument to the parameter it meant.

The table below was transcribed from FlashInfer 0.7.4's sources (flashinfer/decode.py, prefill.py,
page.py, quantization/packbits.py; cascade per its documented API). FlashInfer's decode plan() is
declared `(..., page_size, *deprecated_positional_args, **kwargs)` and binds positional extras in
the order of its _BATCH_DECODE_PLAN_LEGACY_POS_ARGS, with window_right, is_causal and
use_token_head_sf keyword-only: the table records that effective order, which ours declares.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import attnforge

DECODE_PLAN = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
               "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "o_data_type",
               "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "block_tables", "seq_lens",
               "fixed_split_size", "disable_split_kv", "q_len_per_req")
PAGED_PLAN = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
              "num_kv_heads", "head_dim_qk", "page_size", "head_dim_vo", "custom_mask", "packed_custom_mask", "causal",
              "pos_encoding_mode", "use_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap",
              "rope_scale", "rope_theta", "q_data_type", "kv_data_type", "o_data_type", "non_blocking",
              "prefix_len_ptr", "token_pos_in_items_ptr", "token_pos_in_items_len", "max_item_len_ptr", "seq_lens",
              "seq_lens_q", "block_tables", "max_token_per_sequence", "max_sequence_kv", "fixed_split_size",
              "disable_split_kv", "uniform_q_len", "use_token_head_sf")
RAGGED_PLAN = ("qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo", "custom_mask",
               "packed_custom_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left",
               "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta", "q_data_type", "kv_data_type",
               "o_data_type", "non_blocking", "prefix_len_ptr", "token_pos_in_items_ptr", "token_pos_in_items_len",
               "max_item_len_ptr", "fixed_split_size", "disable_split_kv", "seq_lens", "seq_lens_q",
               "max_token_per_sequence", "max_sequence_kv", "v_indptr", "o_indptr", "qo_indptr_cpu", "kv_indptr_cpu",
               "uniform_q_len", "use_token_head_sf")
DECODE_FORWARD = ("q", "paged_kv_cache", "pos_encoding_mode", "q_scale", "k_scale", "v_scale", "window_left",
                  "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta")
PAGED_FORWARD = ("q", "paged_kv_cache", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "k_scale", "v_scale",
                 "window_left", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta")
RAGGED_FORWARD = ("q", "k", "v", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left",
                  "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta")

# (module path, qualified name): (positional parameters in order, keyword-only names, takes *args)
FLASHINFER_074 = {
    ("decode", "BatchDecodeWithPagedKVCacheWrapper.__init__"): (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "use_tensor_cores", "paged_kv_indptr_buffer",
         "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer", "backend", "jit_args", "jit_kwargs"), (), False),
    ("decode", "BatchDecodeWithPagedKVCacheWrapper.plan"): (
        DECODE_PLAN, ("window_right", "is_causal", "use_token_head_sf"), False),
    ("decode", "BatchDecodeWithPagedKVCacheWrapper.begin_forward"): (
        DECODE_PLAN, ("window_right", "is_causal", "use_token_head_sf"), False),
    ("decode", "BatchDecodeWithPagedKVCacheWrapper.run"): (
        ("q", "paged_kv_cache"), ("q_scale", "k_scale", "v_scale", "out", "lse", "return_lse", "enable_pdl",
                                  "window_left", "sinks", "q_len_per_req", "skip_softmax_threshold_scale_factor",
                                  "kv_cache_sf"), True),
    ("decode", "BatchDecodeWithPagedKVCacheWrapper.forward"): (DECODE_FORWARD, (), False),
    ("decode", "BatchDecodeWithPagedKVCacheWrapper.forward_return_lse"): (DECODE_FORWARD, (), False),
    ("decode", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__init__"): (
        ("workspace_buffer", "indptr_buffer", "indices_buffer", "last_page_len_buffer", "kv_layout",
         "use_tensor_cores"), (), False),
    ("decode", "fast_decode_plan"): (
        ("self", "indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
         "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "data_type",
         "sm_scale", "rope_scale", "rope_theta", "non_blocking", "fixed_split_size", "disable_split_kv",
         "q_len_per_req", "global_override_indptr_cpu"), (), False),
    ("decode", "single_decode_with_kv_cache"): (
        ("q", "k", "v", "kv_layout", "pos_encoding_mode", "use_tensor_cores", "q_scale", "k_scale", "v_scale",
         "window_left", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta", "return_lse"), (), False),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.__init__"): (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf", "paged_kv_indptr_buf",
         "paged_kv_indices_buf", "paged_kv_last_page_len_buf", "custom_mask_buf", "mask_indptr_buf", "backend",
         "jit_args", "jit_kwargs"), (), False),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.plan"): (PAGED_PLAN, (), False),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.begin_forward"): (PAGED_PLAN, (), False),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.run"): (
        ("q", "paged_kv_cache"), ("q_scale", "k_scale", "v_scale", "out", "lse", "return_lse", "lse_base",
                                  "lse_layout", "enable_pdl", "window_left", "sinks", "kv_cache_sf",
                                  "skip_softmax_threshold_scale_factor", "use_fp16_softmax", "uses_spcompress"), True),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.forward"): (PAGED_FORWARD, (), False),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.forward_return_lse"): (PAGED_FORWARD, (), False),
    ("prefill", "BatchPrefillWithRaggedKVCacheWrapper.__init__"): (
        ("float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf", "kv_indptr_buf", "custom_mask_buf",
         "mask_indptr_buf", "backend", "jit_args", "jit_kwargs"), (), False),
    ("prefill", "BatchPrefillWithRaggedKVCacheWrapper.plan"): (RAGGED_PLAN, (), False),
    ("prefill", "BatchPrefillWithRaggedKVCacheWrapper.begin_forward"): (RAGGED_PLAN, (), False),
    ("prefill", "BatchPrefillWithRaggedKVCacheWrapper.run"): (
        ("q", "k", "v"), ("q_scale", "k_scale", "v_scale", "o_scale", "out", "lse", "return_lse", "lse_base",
                          "lse_layout", "enable_pdl", "kv_cache_sf"), True),
    ("prefill", "BatchPrefillWithRaggedKVCacheWrapper.forward"): (RAGGED_FORWARD, (), False),
    ("prefill", "BatchPrefillWithRaggedKVCacheWrapper.forward_return_lse"): (RAGGED_FORWARD, (), False),
    ("prefill", "single_prefill_with_kv_cache"): (
        ("q", "k", "v", "scale_q", "scale_k", "scale_v", "o_dtype", "custom_mask", "packed_custom_mask", "causal",
         "kv_layout", "pos_encoding_mode", "use_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap",
         "rope_scale", "rope_theta", "backend", "return_lse", "kv_cache_sf", "k_scale", "v_scale"), (), False),
    ("cascade", "merge_state"): (("v_a", "s_a", "v_b", "s_b"), (), False),
    ("cascade", "merge_state_in_place"): (("v", "s", "v_other", "s_other", "mask"), (), False),
    ("cascade", "merge_states"): (("v", "s"), (), False),
    ("quantization", "packbits"): (("x", "bitorder"), (), False),
    ("quantization", "segment_packbits"): (("x", "indptr", "bitorder"), (), False),
    ("page", "get_seq_lens"): (("kv_indptr", "kv_last_page_len", "page_size"), (), False),
    ("page", "get_batch_indices_positions"): (
        ("append_indptr", "seq_lens", "nnz", "batch_indices", "positions"), (), False),
    ("page", "append_paged_kv_cache"): (
        ("append_key", "append_value", "batch_indices", "positions", "paged_kv_cache", "kv_indices", "kv_indptr",
         "kv_last_page_len", "kv_layout"), (), False),
}

# Names `import flashinfer` exposes at the top level for attention, and where FlashInfer defines them.
TOP_LEVEL = {
    "BatchDecodeWithPagedKVCacheWrapper": "decode", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper": "decode",
    "fast_decode_plan": "decode", "single_decode_with_kv_cache": "decode",
    "BatchPrefillWithPagedKVCacheWrapper": "prefill", "BatchPrefillWithRaggedKVCacheWrapper": "prefill",
    "single_prefill_with_kv_cache": "prefill", "single_prefill_with_kv_cache_return_lse": "prefill",
    "merge_state": "cascade", "merge_state_in_place": "cascade", "merge_states": "cascade",
    "packbits": "quantization", "segment_packbits": "quantization", "append_paged_kv_cache": "page",
    "get_batch_indices_positions": "page", "get_seq_lens": "page",
}


def _resolve(module: str, qualname: str):
    obj = getattr(attnforge, module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("where", sorted(FLASHINFER_074), ids=lambda w: f"{w[0]}.{w[1]}")
def test_signature_matches_flashinfer_074(where):
    positional, keyword_only, var_args = FLASHINFER_074[where]
    params = list(inspect.signature(_resolve(*where)).parameters.values())
    if params and params[0].name == "self" and where[1] != "fast_decode_plan":
        params = params[1:]
    ours = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    assert ours == positional, f"positional order differs from FlashInfer 0.7.4's: {ours} != {positional}"
    names = {p.name for p in params}
    missing = [name for name in keyword_only if name not in names]
    assert not missing, f"keywords FlashInfer 0.7.4 takes and we lack: {missing}"
    assert any(p.kind is p.VAR_POSITIONAL for p in params) == var_args
    assert not any(p.kind is p.VAR_KEYWORD for p in params), "a **kwargs would swallow misspelled arguments"


@pytest.mark.parametrize("name", sorted(TOP_LEVEL))
def test_names_at_flashinfer_paths(name):
    """`import attnforge as flashinfer`: each name at the top level and in FlashInfer's submodule,
    one object at both."""
    module = importlib.import_module(f"attnforge.{TOP_LEVEL[name]}")
    assert getattr(attnforge, name) is getattr(module, name)
    assert getattr(attnforge, TOP_LEVEL[name]) is module


def test_deprecated_aliases_exist():
    for wrapper in (attnforge.BatchDecodeWithPagedKVCacheWrapper, attnforge.BatchPrefillWithPagedKVCacheWrapper,
                    attnforge.BatchPrefillWithRaggedKVCacheWrapper):
        assert wrapper.begin_forward is wrapper.plan
        for name in ("run_return_lse", "forward", "forward_return_lse", "end_forward"):
            assert callable(getattr(wrapper, name)), f"{wrapper.__name__}.{name}"
    assert attnforge.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__mro__[1] is attnforge.BatchDecodeWithPagedKVCacheWrapper
