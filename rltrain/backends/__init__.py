"""Lazy registry of training backends: `backend=fsdp` never imports megatron, and vice versa."""

from __future__ import annotations

import importlib
from typing import Any, Literal

# policy: trainable, from `model.path`; reference: frozen; critic: trainable, a scalar value head on
# the policy's (or `critic.path`'s) transformer.
Role = Literal["policy", "reference", "critic"]
ROLES = ("policy", "reference", "critic")

BACKENDS = {
    "fsdp": "rltrain.backends.fsdp:build_engine",
    "megatron": "rltrain.backends.megatron.engine:build_engine",
}


def build_engine(ctx: Any, role: Role) -> Any:
    """The configured backend's engine for one role of the run (see `Role`); its weights come
    from `ctx.model_dir_for(role)`."""
    if role not in ROLES:
        raise ValueError(f"engine role {role!r} is unknown; choose one of {ROLES}")
    name = ctx.cfg.backend.name
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is unknown; choose one of {sorted(BACKENDS)}")
    module_name, fn_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), fn_name)(ctx, role)
