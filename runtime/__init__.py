"""attnforge: attention kernels generated per spec, with FlashInfer-compatible plan()/run() wrappers.

    import attnforge
    wrapper = attnforge.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 q_data_type=torch.bfloat16)
    o = wrapper.run(q, (k_cache, v_cache))

LSE outputs are base 2 (log2 of the softmax denominator plus the scaled max), as FlashInfer's.
Importing the package does not import torch; the wrappers do on first use.
"""

from __future__ import annotations

import logging

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "fast_decode_plan",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "decode_workspace_size",
    "merge_state",
    "merge_states",
    "merge_state_in_place",
    "packbits",
    "segment_packbits",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "UnsupportedSpecError",
]

_log = logging.getLogger("attnforge")
if not _log.handlers:
    # A first-use compile takes seconds: say so by default instead of looking hung.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[attnforge] %(message)s"))
    _log.addHandler(_handler)
    from .settings import log_level

    _log.setLevel(log_level())

_LAZY = {
    "BatchDecodeWithPagedKVCacheWrapper": ("attnforge.decode", "BatchDecodeWithPagedKVCacheWrapper"),
    "single_decode_with_kv_cache": ("attnforge.decode", "single_decode_with_kv_cache"),
    "BatchPrefillWithPagedKVCacheWrapper": ("attnforge.prefill", "BatchPrefillWithPagedKVCacheWrapper"),
    "BatchPrefillWithRaggedKVCacheWrapper": ("attnforge.prefill", "BatchPrefillWithRaggedKVCacheWrapper"),
    "single_prefill_with_kv_cache": ("attnforge.prefill", "single_prefill_with_kv_cache"),
    "single_prefill_with_kv_cache_return_lse": ("attnforge.prefill", "single_prefill_with_kv_cache_return_lse"),
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper": ("attnforge.decode_graph",
                                                    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper"),
    "fast_decode_plan": ("attnforge.decode_graph", "fast_decode_plan"),
    "merge_state_in_place": ("attnforge.cascade", "merge_state_in_place"),
    "append_paged_kv_cache": ("attnforge.page", "append_paged_kv_cache"),
    "get_batch_indices_positions": ("attnforge.page", "get_batch_indices_positions"),
    "get_seq_lens": ("attnforge.page", "get_seq_lens"),
    "decode_workspace_size": ("attnforge.decode", "decode_workspace_size"),
    "merge_state": ("attnforge.merge", "merge_state"),
    "merge_states": ("attnforge.merge", "merge_states"),
    "packbits": ("attnforge.mask", "packbits"),
    "segment_packbits": ("attnforge.mask", "segment_packbits"),
    "UnsupportedSpecError": ("attnforge.codegen.rules", "UnsupportedSpecError"),
}


# FlashInfer's submodule paths (`flashinfer.cascade.merge_state`), reachable as attributes after
# `import attnforge as flashinfer` alone, as FlashInfer's are.
_SUBMODULES = frozenset({"decode", "prefill", "cascade", "page", "quantization"})


def __getattr__(name: str):
    # The CLI imports attnforge.codegen without paying for torch; the API loads on first touch.
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"attnforge.{name}")
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnforge' has no attribute {name!r}")
