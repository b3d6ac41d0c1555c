"""The fa3 kernel's mbarrier arrivals in its machine code: cp.async copies arrive on a stage's full
barrier in the form compute-sanitizer's synccheck follows (arrive-on .noinc, an arrival count:
ARRIVES.LDGSTSBAR.64.ARVCNT), never in the counting form, which ptxas lowers to a transaction
count per thread (ARRIVES.LDGSTSBAR.64.TRANSCNT) and synccheck reports as a missing wait."""

from __future__ import annotations

import pytest

from attnforge.codegen.dtypes import DType
from attnforge.codegen.spec import Arch, Backend, KernelSpec, Kind

FA3 = KernelSpec(kind=Kind.PREFILL, backend=Backend.FA3, dtype_q=DType.BF16, dtype_kv=DType.BF16,
                 dtype_o=DType.BF16, head_dim_qk=128, head_dim_vo=128, archs=(Arch.SM90A,))


@pytest.mark.nvcc
def test_gathered_tiles_arrive_by_count_not_by_transaction(module_cache, sass_of):
    from attnforge.loader import load_uncached

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNFORGE_CACHE_DIR", str(module_cache))
        sass = sass_of(load_uncached(FA3).path)
    prefill = [s for s in sass.split("Function : ")[1:] if "prefill_kernel" in s.splitlines()[0]]
    assert len(prefill) == 2  # paged and ragged
    for kernel in prefill:
        assert "ARRIVES.LDGSTSBAR.64.ARVCNT" in kernel  # gathered Q and K/V tiles
        assert "ARRIVES.LDGSTSBAR.64.TRANSCNT" not in kernel
