"""Moving an engine's AdamW state between its device and host memory (time sharing's offload and
onload), one rule for both backends: every state tensor moves except `step`, which torch's AdamW
keeps on the CPU unless it is capturable (a CUDA step would cost a host sync per parameter)."""

from __future__ import annotations

import torch


def move_optimizer_state(optimizer: torch.optim.Optimizer | None, device: torch.device | str) -> None:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)
