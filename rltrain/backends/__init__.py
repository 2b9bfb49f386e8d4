"""Training backends behind one protocol (`base.TrainEngine`): Hugging Face + FSDP2 (`fsdp/`) and
megatron-core (`megatron/`), with what both share (roles, LR schedule, value head, chunked head,
optimizer-state offload). The registry below is lazy: `backend=fsdp` never imports megatron.
docs/backends.md compares the two.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from rltrain.backends.base import TrainEngine
from rltrain.backends.roles import ROLES, Role

if TYPE_CHECKING:
    from rltrain.algos.base import RunContext

BACKENDS = {
    "fsdp": "rltrain.backends.fsdp.engine:build_engine",
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
