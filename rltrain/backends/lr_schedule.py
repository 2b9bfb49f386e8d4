"""Learning-rate schedule as a pure function of the number of optimizer steps taken.

Keeping it pure (instead of a stateful torch scheduler) makes resume trivial and lets a skipped
(non-finite) step leave the schedule where it was: only steps actually taken advance it.
"""

from __future__ import annotations

import math

from rltrain.config.schema import OptimConfig


def lr_at(steps_taken: int, cfg: OptimConfig, max_steps: int) -> float:
    """LR for the next optimizer step after `steps_taken` real steps."""
    if cfg.warmup_steps > 0 and steps_taken < cfg.warmup_steps:
        return cfg.lr * (steps_taken + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (steps_taken - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    if cfg.schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"optim.schedule={cfg.schedule!r}: use cosine, linear or constant")
