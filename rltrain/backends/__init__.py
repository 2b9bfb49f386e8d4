"""Training backends behind one protocol (`base.TrainEngine`): Hugging Face + FSDP2 (`fsdp/`) and
megatron-core (`megatron/`), with what both share (roles, AdamW, LR schedule, value head, chunked
head, optimizer-state offload, a reward model written as a sequence classifier). The registry below is lazy: `backend=fsdp` never imports megatron.
docs/backends.md compares the two.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from rltrain.backends.base import LogProbScorer, TrainEngine
from rltrain.backends.roles import ROLES, Role

if TYPE_CHECKING:
    from rltrain.config.run_context import RunContext

BACKENDS = {
    "fsdp": "rltrain.backends.fsdp.build:build_engine",
    "megatron": "rltrain.backends.megatron.engine:build_engine",
}


def build_engine(ctx: RunContext, role: Role, max_steps: int) -> TrainEngine:
    """The configured backend's engine for one role of the run (`roles.Role`); its weights come
    from `ctx.model_dir_for(role)`. `max_steps`: the optimizer steps its LR schedule spans."""
    if role not in ROLES:
        raise ValueError(f"engine role {role!r} is unknown; choose one of {ROLES}")
    name = ctx.cfg.backend.name
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is unknown; choose one of {sorted(BACKENDS)}")
    module_name, fn_name = BACKENDS[name].split(":")
    return cast(TrainEngine, getattr(importlib.import_module(module_name), fn_name)(ctx, role, max_steps))


def build_reference(ctx: RunContext, policy: TrainEngine, max_steps: int) -> tuple[LogProbScorer, TrainEngine | None]:
    """The frozen reference, and the engine it owns (None when it owns none). A LoRA policy with no
    `reference.path` of its own scores its base with the adapters off: no second copy of the model
    (docs/lora.md); any other run builds a reference engine."""
    base = policy.base_weights()
    if base is not None and "reference" not in ctx.role_dirs:
        return base, None
    engine = build_engine(ctx, "reference", max_steps)
    return engine, engine
