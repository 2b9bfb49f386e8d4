"""The critic's scalar value head, shared by both training backends.

A fresh head drawn from a generator seeded by `trainer.seed`, on the CPU in fp32, so that every rank
and both backends start from the same head bit for bit; values are always computed in fp32.
docs/internals/backends.md explains the initialisation and the precision.
"""

from __future__ import annotations

import torch
from torch import nn

from rltrain.models.hf_io import fill_parameter


def initial_value_head(hidden_size: int, seed: int) -> dict[str, torch.Tensor]:
    """`{"weight": [1, H], "bias": [1]}` in fp32 on the CPU, a pure function of (hidden_size, seed)."""
    generator = torch.Generator().manual_seed(seed)
    weight_1H = torch.randn(1, hidden_size, generator=generator, dtype=torch.float32) / (hidden_size + 1) ** 0.5
    return {"weight": weight_1H, "bias": torch.zeros(1, dtype=torch.float32)}


def new_value_head(
    hidden_size: int, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu", bias: bool = True
) -> nn.Linear:
    """`Linear(hidden, 1)` holding `initial_value_head(hidden_size, seed)` (on the meta device:
    the shapes only, for a sharded engine to fill after allocating its shards). `bias=False`: a
    reward model's head, shaped like a Hugging Face sequence classifier's score layer."""
    head = nn.Linear(hidden_size, 1, dtype=dtype, device=device, bias=bias)
    if torch.device(device).type != "meta":
        with torch.no_grad():
            for name, param in head.named_parameters():
                param.copy_(initial_value_head(hidden_size, seed)[name])
    return head


def fill_value_head(head: nn.Linear, seed: int, dtype: torch.dtype, group) -> None:
    """A sharded head's rows from the seeded draw, which rank 0 makes and scatters (`to_empty`
    left them uninitialised). Collective over `group`."""
    initial = initial_value_head(head.in_features, seed) if torch.distributed.get_rank() == 0 else {}
    for name, param in head.named_parameters():
        fill_parameter(param, initial[name].to(param.device, dtype) if initial else None, group)


def head_values(head: nn.Linear, hidden_NH: torch.Tensor) -> torch.Tensor:
    """Values [N] in fp32 for hidden states [N, H], with autocast off (see the module docstring)."""
    with torch.autocast(hidden_NH.device.type, enabled=False):
        # A matrix-vector product, not F.linear(...).squeeze(-1): a fresh tensor rather than a view
        # (FSDP rightly warns about a wrapped module returning views).
        values_N = hidden_NH.float() @ head.weight[0].float()
        return values_N if head.bias is None else values_N + head.bias.float()
