"""Lazy registry of training backends: `backend=fsdp` never imports megatron, and vice versa."""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS = {
    "fsdp": "rltrain.backends.fsdp:build_engine",
    "megatron": "rltrain.backends.megatron.engine:build_engine",
}


def build_engine(ctx: Any, trainable: bool) -> Any:
    """The configured backend's engine for the run's model: the policy (trainable) or a frozen
    copy of it (the reference)."""
    name = ctx.cfg.backend.name
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is unknown; choose one of {sorted(BACKENDS)}")
    module_name, fn_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), fn_name)(ctx, trainable)
