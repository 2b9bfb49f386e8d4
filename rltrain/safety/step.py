"""A collective-safe optimizer step.

Every rank reaches the same verdict from one MIN all-reduce of a finite flag. On a non-finite grad
norm every rank drops its gradients (None, not zero: Adam would still move weights on zero grads
through its moment estimates) and calls `optimizer.step()` anyway, which is then a no-op, so the
ranks stay in lock-step and the LR schedule does not advance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rltrain.runtime.distributed import all_ranks_agree


@dataclass
class StepOutcome:
    grad_norm: float
    skipped: bool


def global_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip in place to `max_norm` (<= 0: no clipping) and return the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def safe_optimizer_step(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter], max_norm: float
) -> StepOutcome:
    params = list(params)
    norm = global_grad_norm(params, max_norm)
    if not all_ranks_agree(math.isfinite(norm)):
        for p in params:
            p.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm=norm, skipped=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(grad_norm=norm, skipped=False)
