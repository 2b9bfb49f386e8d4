"""The AdamW both backends step, with `optim.implementation` choosing torch's kernels: a launch per
tensor (`for-loop`), per list of tensors (`foreach`) or one fused kernel (`fused`). They compute
the same update but round differently, so `auto` keeps each backend's own choice (FSDP foreach,
megatron for-loop) and with it every CPU run's numbers; `fused` is the GPU candidate measured in
docs/gpus.md.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rltrain.config.schema import OptimConfig


def build_adamw(params: Iterable[torch.nn.Parameter], cfg: OptimConfig, lr: float, backend_default: str) -> torch.optim.AdamW:
    """AdamW over `params` starting at `lr`; `backend_default` is the kernel `auto` means."""
    implementation = backend_default if cfg.implementation == "auto" else cfg.implementation
    kernels = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[implementation]
    return torch.optim.AdamW(
        list(params), lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **kernels
    )
