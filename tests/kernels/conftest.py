"""Fixtures the GPU kernel tests share."""

from __future__ import annotations

import pytest

from attnforge import prefill_plan_steps as plan_steps


@pytest.fixture
def pages_gathered(monkeypatch):
    """pages_gathered(gather): fa3 paged plans copy their pages into ragged K and V before the kernel
    (True) or have the kernel read the pages (False), whatever their lengths. Returns the list that
    records each plan that gathered (the workspace may still refuse the copy)."""
    gathered = []
    real = plan_steps.gathered_rows

    def force(gather: bool) -> list:
        monkeypatch.setattr(plan_steps, "gathers_pages", lambda *args: gather)
        monkeypatch.setattr(plan_steps, "gathered_rows", lambda *args: gathered.append(args) or real(*args))
        return gathered

    return force
