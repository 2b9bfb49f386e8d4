"""The backend registry's entry for `backend=fsdp` (rltrain/backends/__init__.py): an FSDPEngine for
one role, its options read from the composed config."""

from __future__ import annotations

from pathlib import Path

from rltrain.backends.fsdp.engine import FSDPEngine
from rltrain.backends.roles import engine_options, role_build
from rltrain.config.algorithms import spec_of
from rltrain.config.run_context import RunContext
from rltrain.models import moe


def build_engine(ctx: RunContext, role: str, max_steps: int) -> FSDPEngine:
    """The backend registry's entry (`backend=fsdp`) for one role (rltrain.backends.Role)."""
    cfg = ctx.cfg
    build = role_build(ctx, role)
    return FSDPEngine(
        build.model_dir, cfg.backend, build.optim, max_steps, ctx.dist.device, adapters=build.adapters,
        seed=int(cfg.trainer.seed), freeze_vision=bool(cfg.model.freeze_vision),
        router_losses=moe.router_losses(
            cfg.model.moe.aux_loss_coef, float(cfg.model.moe.z_loss_coef), spec_of(cfg.algo.name).generates
        ),
        router_replay=bool(cfg.algo.get("router_replay", False)),  # an RL algorithm's key (algos/rl/config.py)
        reads_routing=Path(build.model_dir) == Path(ctx.model_dir),
        **engine_options(ctx, build),
    )
