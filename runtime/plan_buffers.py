"""What every wrapper's plan() shares: the float workspace, the plan image's pinned host and
device buffers with their one asynchronous upload, the caller's stream, and the output checks."""

from __future__ import annotations

import functools
import math

import torch

from . import checks

LOG2_E = math.log2(math.e)


def current_stream(device_index: int) -> int:
    """The caller's current stream on the device, as a raw handle (the public accessor builds a
    Stream object per call, a few µs that every run() would pay)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


def cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def split_tokens(fixed_split_size, page_size: int) -> int:
    """fixed_split_size (pages) in kv tokens; 0 for an automatic split."""
    return fixed_split_size * page_size if fixed_split_size and fixed_split_size > 0 else 0


def score_scales(sm_scale: float, soft_cap: float) -> tuple[float, float]:
    """(multiplier of q.k, multiplier after tanh) that put scores in the kernels' base-2 domain: with
    a soft cap s = cap * log2(e) * tanh(q.k * sm_scale / cap), else s = q.k * sm_scale * log2(e)."""
    if soft_cap > 0:
        return sm_scale / soft_cap, soft_cap * LOG2_E
    return sm_scale * LOG2_E, LOG2_E


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def float_workspace(buffer, name: str = "float_workspace_buffer") -> torch.Tensor:
    checks.tensor(buffer, name)
    if not buffer.is_cuda or not buffer.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous CUDA tensor, got "
                         f"{'a non-contiguous' if buffer.is_cuda else 'a ' + str(buffer.device)} tensor")
    return buffer


# Pinned host images dropped while the module's own upload of them may still be in flight, each
# with the event recorded after that upload; held until the event completes (see HostImage).
_RETIRED_HOST_IMAGES: list[tuple[torch.Tensor, torch.cuda.Event]] = []


class HostImage:
    """A plan image's pinned host buffer and the event recorded after each upload of it. The buffer
    is refilled or replaced only after its last upload finished. The decode module copies with its
    own cudaMemcpyAsync, which torch's host allocator does not see: a buffer freed before that copy
    ran (its wrapper collected right after run()) could be handed to another plan() and refilled
    under the copy, so the decode wrapper retires its buffer when it goes, holding it until then
    (torch's own copy_, prefill's upload, records the buffer's use itself)."""

    def __init__(self) -> None:
        self.host = torch.empty(0, dtype=torch.int32)
        self.upload_done: torch.cuda.Event | None = None

    def buffer(self, size: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """A pinned buffer of `size` int32 entries that no upload reads any more."""
        _RETIRED_HOST_IMAGES[:] = [(host, done) for host, done in _RETIRED_HOST_IMAGES if not done.query()]
        if self.upload_done is not None:
            self.upload_done.synchronize()
        else:
            # torch creates the CUDA event at its first record; the uploads record it from then on.
            self.upload_done = torch.cuda.Event()
            self.upload_done.record(stream)
        if self.host.numel() < size:
            self.host = torch.empty(size, dtype=torch.int32, pin_memory=True)
        return self.host

    def retire(self) -> None:
        """Called when the owner goes: keep the buffer while its last upload may still read it."""
        if self.upload_done is not None and self.host.numel() > 0 and not self.upload_done.query():
            _RETIRED_HOST_IMAGES.append((self.host, self.upload_done))


class PlanImage:
    """The int32 plan image: filled on the host in pinned memory (HostImage), uploaded with one async
    copy, by torch (upload) or by a module (decode: its own copy records staging.upload_done). Under
    CUDA graphs the device buffer never moves (captured kernels hold its address)."""

    def __init__(self, device: torch.device, fixed_address: bool) -> None:
        self.device = device
        self.fixed_address = fixed_address
        self.staging = HostImage()
        self.on_device = torch.empty(0, dtype=torch.int32, device=device)

    def host_buffer(self, size: int) -> torch.Tensor:
        """The pinned host image of `size` int32 entries, and a device image at least that large."""
        host = self.staging.buffer(size, torch.cuda.current_stream(self.device))
        if self.on_device.numel() < size:
            if self.fixed_address and self.on_device.numel() > 0:
                raise ValueError("plan(): a CUDA-graph wrapper cannot grow its plan buffer; keep batch size and "
                                 "heads fixed across plans")
            self.on_device = torch.empty(size, dtype=torch.int32, device=self.device)
        return host

    def upload(self, size: int) -> None:
        self.on_device[:size].copy_(self.staging.host[:size], non_blocking=True)
        self.staging.upload_done.record()

    def read_slot(self, index: int) -> int:
        """A header slot as the kernels left it (synchronizes: debug paths only)."""
        torch.cuda.synchronize(self.device)
        return int(self.on_device[index])


def output(out, name: str, shape: tuple, dtype: torch.dtype, device: torch.device, why: str) -> torch.Tensor:
    """The caller's `out` checked against what plan() promised, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return checks.planned_tensor(out, name, shape, why, planned_dtype=dtype, dtype_arg="o_data_type", on=device)


def lse_output(lse, shape: tuple, device: torch.device, why: str) -> torch.Tensor:
    if lse is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    checks.tensor(lse, "lse")
    checks.dtype(lse, "lse", torch.float32)
    checks.device(lse, "lse", device)
    checks.shape(lse, "lse", shape, why)
    if not lse.is_contiguous():
        raise ValueError("lse: expected a contiguous tensor")
    return lse
