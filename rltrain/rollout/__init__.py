"""Rollout engines behind one protocol (`base.RolloutEngine`): vLLM in the trainer's process (`vllm`; its CPU KV cache
`kv_budget`) or in a child (`separate`, `separate_child`, their JSON `control_wire`; in flight: `inflight_*`), vLLM's API
servers over HTTP (the `server` subpackage), transformers' generate (`hf`); images in `images` (and `hf_images`); `seeds`
seeds a prompt alike in every vLLM engine. The registry below is lazy, so `rollout=hf` never imports vLLM; `share` hands
a model-parallel replica's completions to its peers. docs/internals/rollout.md.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from rltrain.config.run_context import RunContext
    from rltrain.rollout.base import RolloutEngine

ROLLOUTS = {
    "vllm": "rltrain.rollout.vllm:build_engine",
    "vllm/separate": "rltrain.rollout.separate:build_engine",  # rollout.process=separate
    "hf": "rltrain.rollout.hf:build_engine",
    "server": "rltrain.rollout.server.build:build_engine",  # vLLM API servers over HTTP (docs/rollout-servers.md)
}
# The literal's values, without importing the config schema (torch) at package import: a spawned
# server's guard (server/guard.py) is a module of this package and must stay a small process.
PROCESSES: tuple[str, ...] = ("colocated", "separate")


def build_rollout(ctx: RunContext) -> RolloutEngine:
    from rltrain.config.group_choice import as_option
    from rltrain.config.group_options import VLLMRolloutConfig

    name = ctx.cfg.rollout.name
    if name not in ROLLOUTS:
        raise ValueError(f"rollout={name!r} is unknown; choose one of {sorted(ROLLOUTS)}")
    vllm = as_option("rollout", ctx.cfg.rollout, VLLMRolloutConfig)  # only vLLM's schema has `process`
    process = vllm.process if vllm is not None else "colocated"
    if process not in PROCESSES:
        raise ValueError(f"rollout.process={process!r} is unknown; choose one of {PROCESSES}")
    if process == "separate":
        name = f"{name}/separate"
    # vLLM logs every weight reload and cache reset at INFO; keep the console for training.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    module_name, fn_name = ROLLOUTS[name].split(":")
    return cast("RolloutEngine", getattr(importlib.import_module(module_name), fn_name)(ctx))
