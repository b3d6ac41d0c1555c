"""run()'s per-call tensor checks in O(1) after the first call of a shape.

An engine calls run() once per layer per step with tensors of one form: each layer's q, each
layer's own KV cache, all of one dtype, device, shape and strides. The full checks (which name the
argument, what was expected and what was given) run the first time a plan sees a tensor of a given
form; a later tensor of the same form is accepted after checking only what its form does not
cover, the 16-byte alignment of its data. Forms are accepted per argument: q's form says nothing
about out, whose planned dtype and shape may differ (an fp8 q with a bf16 out). A re-plan starts
with nothing accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import checks, kv_cache


def form(x: torch.Tensor) -> tuple:
    """Everything a full check reads from a tensor except its address."""
    return x.dtype, x.get_device(), x.shape, x.stride()


@dataclass(frozen=True, slots=True)
class PagedCache:
    """A checked paged cache as a kernel takes it: K and V addresses, pages, (page, token, head)
    element strides of K (V's are equal: the kernels resolve a page once for both)."""

    k_ptr: int
    v_ptr: int
    num_pages: int
    strides: tuple[int, int, int]


class Accepted:
    """The tensor forms one plan's full checks accepted, each for the argument it was checked as."""

    __slots__ = ("_forms", "_paged")

    def __init__(self) -> None:
        self._forms: set[tuple] = set()
        self._paged: dict[tuple, tuple[int, tuple[int, int, int], int]] = {}

    def known(self, x, name: str) -> bool:
        """Whether x has a form a full check accepted as argument `name` (and aligned data): no
        check needed."""
        return isinstance(x, torch.Tensor) and not x.data_ptr() % 16 and (name, form(x)) in self._forms

    def sinks_ptr(self, sinks, num_qo_heads: int, device: torch.device) -> int | None:
        """The address of run()'s attention sinks (None: no sinks), fully checked the first time a
        form is seen. Kernels read them as fp32 scalars, so any address of a float32 tensor will do."""
        if sinks is None:
            return None
        if not (isinstance(sinks, torch.Tensor) and ("sinks", form(sinks)) in self._forms):
            self._forms.add(("sinks", form(checks.sinks(sinks, num_qo_heads, device))))
        return sinks.data_ptr()

    def ensure(self, x, name: str, check) -> None:
        """check(x) (which raises for a bad x) unless x's form was accepted as argument `name`; then
        accept it as that."""
        if not self.known(x, name):
            check(x)
            self._forms.add((name, form(x)))

    def paged(self, paged_kv_cache, check) -> PagedCache:
        """The cache's PagedCache. check(paged_kv_cache) -> (k_cache, v_cache, strides) runs the full
        checks the first time a form is seen (a (k, v) pair's forms, or one [pages, 2, ...] tensor's)."""
        pair = isinstance(paged_kv_cache, (tuple, list))
        key = _paged_form(paged_kv_cache, pair)
        known = self._paged.get(key) if key is not None else None
        if known is None:
            k_cache, v_cache, strides = check(paged_kv_cache)
            known = (k_cache.shape[0], strides, v_cache.data_ptr() - k_cache.data_ptr())
            if key is not None:
                self._paged[key] = known
        num_pages, strides, v_offset = known
        if pair:
            k_ptr, v_ptr = paged_kv_cache[0].data_ptr(), paged_kv_cache[1].data_ptr()
        else:
            k_ptr = paged_kv_cache.data_ptr()
            v_ptr = k_ptr + v_offset
        if k_ptr % 16 or v_ptr % 16:
            check(paged_kv_cache)  # raises, naming the misaligned cache
        return PagedCache(k_ptr, v_ptr, num_pages, strides)


def _paged_form(paged_kv_cache, pair: bool) -> tuple | None:
    if pair:
        if len(paged_kv_cache) != 2 or not all(isinstance(x, torch.Tensor) for x in paged_kv_cache):
            return None
        k, v = paged_kv_cache
        # V's offset from K is part of a pair's form only through both addresses, so pairs are keyed
        # by both forms and their pointers are read per call.
        return form(k), form(v)
    return (form(paged_kv_cache),) if isinstance(paged_kv_cache, torch.Tensor) else None


def checked_paged(paged_kv_cache, kv_layout: str, page_size: int, num_kv_heads: int, head_dim_qk: int,
                  head_dim_vo: int, dtype: torch.dtype, device: torch.device):
    """The full paged-cache check: (k_cache, v_cache, their common (page, token, head) strides)."""
    k_cache, v_cache = kv_cache.split_paged(paged_kv_cache, kv_layout, page_size, num_kv_heads, head_dim_qk,
                                            head_dim_vo, dtype, device)
    strides = kv_cache.paged_strides(k_cache, kv_layout)
    v_strides = kv_cache.paged_strides(v_cache, kv_layout)
    if v_strides != strides:
        # The kernels resolve each page id once per tile into one row offset for K and V.
        raise ValueError(f"paged_kv_cache: k and v caches must have equal (page, token, head) strides, got "
                         f"{strides} and {v_strides}; with head_dim_vo < head_dim_qk store V in pages of K's shape "
                         "and pass v_cache[..., :head_dim_vo]")
    return k_cache, v_cache, strides
