"""FlashInfer's CUDA-graph decode entry points: CUDAGraphBatchDecodeWithPagedKVCacheWrapper (the
positional constructor engines call) and fast_decode_plan, the cheap per-step re-plan engines install
with `wrapper.plan = functools.partial(fast_decode_plan, wrapper)`.

fast_decode_plan goes through the wrapper's own planning path with reuse on: when only the page
table changed since the last plan, the checked knobs and the module are kept, and under CUDA graphs
the page ids are read from the buffer the engine wrote (no copy), as FlashInfer's does.
"""

from __future__ import annotations

import torch

from .decode import BatchDecodeWithPagedKVCacheWrapper
from .decode_inputs import DecodePlanInputs, check_q_len, resolve_data_type


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """BatchDecodeWithPagedKVCacheWrapper in CUDA-graph mode over the caller's index buffers, with
    FlashInfer's positional constructor. The batch size is len(last_page_len_buffer)."""

    def __init__(self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor, indices_buffer: torch.Tensor,
                 last_page_len_buffer: torch.Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False) -> None:
        for name, buffer in (("indptr_buffer", indptr_buffer), ("indices_buffer", indices_buffer),
                             ("last_page_len_buffer", last_page_len_buffer)):
            if not isinstance(buffer, torch.Tensor):
                raise TypeError(f"{name}: expected a preallocated int32 CUDA tensor, got {type(buffer).__name__}")
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


def fast_decode_plan(self: BatchDecodeWithPagedKVCacheWrapper, indptr: torch.Tensor, indices: torch.Tensor,
                     last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                     pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap: float | None = None,
                     q_data_type=None, kv_data_type=None, data_type=None, sm_scale: float | None = None,
                     rope_scale: float | None = None, rope_theta: float | None = None, non_blocking: bool = True,
                     fixed_split_size: int | None = None, disable_split_kv: bool = False, q_len_per_req: int = 1,
                     global_override_indptr_cpu: torch.Tensor | None = None) -> None:
    """FlashInfer's fast_decode_plan: plan() for a wrapper that was planned before, with the same
    arguments plus global_override_indptr_cpu (a host copy of indptr, so no device read is needed).
    The output dtype is the previous plan's (FlashInfer's takes no o_data_type)."""
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper):
        raise TypeError(f"fast_decode_plan: the first argument must be a BatchDecodeWithPagedKVCacheWrapper, got "
                        f"{type(self).__name__}")
    q_len_per_req = check_q_len(q_len_per_req, None, self.use_tensor_cores)
    q_data_type, kv_data_type = resolve_data_type(q_data_type, kv_data_type, data_type)
    previous = self._plan_inputs
    o_data_type = previous.o_data_type if previous is not None else None
    inputs = DecodePlanInputs(
        indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode,
        window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, sm_scale, rope_scale, rope_theta,
        fixed_split_size, disable_split_kv, q_len_per_req)
    self._plan_from(inputs, host_indptr=global_override_indptr_cpu, reuse=previous is not None)
