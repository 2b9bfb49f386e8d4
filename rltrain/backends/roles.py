"""What each role's engine is built from (rltrain.backends.Role), the same on every backend.

- policy: `model.path`'s weights (`ctx.model_dir_for`), trainable with `optim`, the LM head.
- reference: frozen, the LM head.
- critic: `ctx.model_dir_for("critic")` (the policy's weights unless `critic.path` names another
  model), a fresh scalar value head seeded by `trainer.seed` (rltrain.backends.value_head), and its
  own AdamW: `optim`'s settings with `critic.lr` as the learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


@dataclass(frozen=True)
class RoleBuild:
    model_dir: Path
    optim: Any | None  # an OptimConfig-shaped node; None builds a frozen engine
    value_head_seed: int | None  # a critic's head seed; None scores log-probabilities (LM head)


def role_build(ctx: Any, role: str) -> RoleBuild:
    cfg = ctx.cfg
    model_dir = Path(ctx.model_dir_for(role))
    if role == "policy":
        return RoleBuild(model_dir, cfg.optim, None)
    if role == "reference":
        return RoleBuild(model_dir, None, None)
    if role == "critic":
        return RoleBuild(model_dir, OmegaConf.merge(cfg.optim, {"lr": float(cfg.critic.lr)}), int(cfg.trainer.seed))
    raise ValueError(f"engine role {role!r} is unknown; choose one of policy, reference, critic")
