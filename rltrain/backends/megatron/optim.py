"""Megatron's AdamW (rltrain/backends/adamw.py) steps each rank's local shards (the learning-rate
schedule is `rltrain.backends.lr_schedule.lr_at`); this module fills in the state a checkpoint needs.

AdamW is elementwise, so stepping each rank's shard is the same as stepping the full tensor: no
distributed optimizer is needed for correctness (megatron's distributed optimizer would shard the
moments further across data-parallel ranks; a memory optimisation for later). The schedule is a
pure function of the optimizer step so that a resumed run follows the same curve.
"""

from __future__ import annotations

import torch


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zero moments for parameters that have not stepped yet (so a checkpoint always has
    them); AdamW treats step 0 with zero moments exactly like a fresh state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                # torch keeps `step` on the host, except for its fused kernel (optim.implementation=fused)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if group.get("fused") else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
