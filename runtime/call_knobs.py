"""FlashInfer's deprecated forward()/forward_return_lse(): run() with plan-time knobs given at call time.

FlashInfer's forward stores its knobs on the wrapper (they replace plan()'s until the next plan) and
runs. Serving engines rely on that: SGLang plans with the defaults and passes causal, sm_scale,
logits_soft_cap and window_left to forward. Here a knob equal to the planned one costs nothing;
sm_scale and a soft cap of unchanged on/off state are run-time scalars and are replaced in place;
any other change plans again with the new knobs (once: later calls then match). A change that
needs a new plan while a CUDA graph is being captured is refused, naming the knob.
"""

from __future__ import annotations

import math

import torch

from . import checks, dispatch

# Knobs a plan's launch parameters hold as plain scalars: replaced without planning again.
RUN_TIME_SCALARS = ("sm_scale", "soft_cap")


def normalized(head_dim_qk: int, *, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
               rope_theta, causal: bool | None = None) -> dict:
    """Knob values in the form plan() keeps them (None and 0 soft caps equal, sm_scale None is
    1/sqrt(head_dim_qk)), so equal meanings compare equal."""
    knobs = {
        "pos_encoding": dispatch.parse_pos_encoding(pos_encoding_mode),
        "window_left": checks.window_left(window_left),
        "soft_cap": checks.soft_cap(logits_soft_cap),
        "sm_scale": checks.positive_float(sm_scale, "sm_scale", 1.0 / math.sqrt(head_dim_qk)),
        "rope_scale": checks.positive_float(rope_scale, "rope_scale", 1.0),
        "rope_theta": checks.positive_float(rope_theta, "rope_theta", 1e4),
    }
    if causal is not None:
        knobs["causal"] = bool(causal)
    return knobs


def _same(a, b) -> bool:
    # head_dim ** -0.5 and 1 / sqrt(head_dim) differ in the last bit: the same scale.
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


def changed(given: dict, planned: dict) -> list[str]:
    """Names of the knobs whose call-time value differs from the planned one."""
    return [name for name, value in given.items() if not _same(planned[name], value)]


def needs_new_plan(names: list[str], given: dict, planned: dict) -> bool:
    """Whether the changes go beyond run-time scalars (a soft cap turned on or off selects another
    kernel); refused while a CUDA graph is being captured, where plan() cannot run."""
    replan = [n for n in names if n not in RUN_TIME_SCALARS
              or (n == "soft_cap" and (given[n] > 0) != (planned[n] > 0))]
    if replan and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        detail = ", ".join(f"{n}={given[n]!r} (planned {planned[n]!r})" for n in replan)
        raise ValueError(f"forward(): {detail} differ from plan()'s; changing them needs a new plan, which cannot "
                         "run during CUDA-graph capture: pass them to plan() instead")
    return bool(replan)
