"""A labelled work-around for one Fast-LLM behaviour that breaks the contract's AdamW (applied by probe).

``adam_step``: without apex (on CPU, and on GPUs without apex), Fast-LLM's ``fused_adam``
(``fast_llm/core/kernels.py``) falls back to ``torch.optim.adamw.adamw`` and passes the step number as
``state_steps``; torch's functional AdamW increments the steps it is given before using them, so every
update is bias-corrected for the *next* step (step 1 is corrected as step 2: with betas (0.9, 0.999) it
moves a parameter by 0.74 lr instead of lr). Apex's kernel and Fast-LLM's Triton kernel take the step
as is. The fix wraps the optimizer module's ``fused_adam`` to pass ``step - 1`` to that fallback.

It is applied only when :func:`adam_step_is_off_by_one` sees the off-by-one on the device in use, so it
switches itself off once Fast-LLM passes the right step; ``adapters/fast_llm/tests/test_fixes.py``
asserts that this Fast-LLM still needs it (and fails when it no longer does: then delete this module).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["adam_step_is_off_by_one", "apply_adam_step_fix"]

_APPLIED = "_pipelinerl_sdk_adam_step_fix"


def adam_step_is_off_by_one(device: torch.device, fused_adam: Any = None) -> bool:
    """Run Fast-LLM's ``fused_adam`` for step 1 on one element (p=1, g=1, lr=1, no decay, eps=0):
    AdamW gives p=0 exactly (bias-corrected m/sqrt(v) is 1); the off-by-one gives ~0.256."""
    if fused_adam is None:
        from fast_llm.engine.optimizer import optimizer

        fused_adam = optimizer.fused_adam
    p, g = torch.ones(1, device=device), torch.ones(1, device=device)
    m, v = torch.zeros(1, device=device), torch.zeros(1, device=device)
    noop = torch.zeros(1, dtype=torch.int32, device=device)
    fused_adam(
        params=[p], grads=[g], exp_avgs=[m], exp_avg_sqs=[v], noop_flag=noop,
        lr=1.0, beta1=0.9, beta2=0.999, wd=0.0, eps=0.0, step=1,
    )  # fmt: skip
    return bool(abs(float(p[0])) > 1e-6)


def apply_adam_step_fix(device: torch.device) -> bool:
    """Wrap ``fast_llm.engine.optimizer.optimizer.fused_adam`` to pass ``step - 1`` if (and only if) the
    probe shows the off-by-one; idempotent. Returns whether the fix is in place."""
    from fast_llm.engine.optimizer import optimizer

    if getattr(optimizer.fused_adam, _APPLIED, False):
        return True
    if not adam_step_is_off_by_one(device, optimizer.fused_adam):
        return False
    original = optimizer.fused_adam

    @functools.wraps(original)
    def fused_adam(*args: Any, step: int, **kwargs: Any) -> None:
        original(*args, step=step - 1, **kwargs)

    setattr(fused_adam, _APPLIED, True)
    optimizer.fused_adam = fused_adam
    return True
