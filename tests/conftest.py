"""Shared test setup: GPU tests carry @pytest.mark.gpu and skip cleanly without a CUDA device;
tests that compile carry @pytest.mark.nvcc and skip without nvcc."""

from __future__ import annotations

import shutil

import pytest


def _cuda_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    return True, ""


def pytest_collection_modifyitems(config, items):
    has_gpu, why = _cuda_available()
    has_nvcc = shutil.which("nvcc") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {why}"))
        if "nvcc" in item.keywords and not has_nvcc:
            item.add_marker(pytest.mark.skip(reason="needs nvcc on the PATH"))
