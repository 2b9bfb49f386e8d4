"""The FSDP engine's training checkpoints: sharded weights and AdamW state, and the step count.

torch.distributed.checkpoint writes and reads each rank's own shards, so no rank gathers the
model. With LoRA only the adapters and their optimizer state are kept: the frozen base is read
from the model directory again on resume (docs/internals/models.md, "Checkpoints").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

VALUE_HEAD = "value_head."  # CompletionValuer's head: trained in full, with LoRA too

if TYPE_CHECKING:
    from peft import PeftModel


def save(
    directory: Path,
    scorer: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    adapters: PeftModel | None,
    steps_taken: int,
    rank: int,
) -> None:
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = checkpoint_state(scorer, optimizer, adapters)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory / "engine"))
    if rank == 0:
        (directory / "engine_state.json").write_text(json.dumps({"steps_taken": steps_taken}))


def load(directory: Path, scorer: nn.Module, optimizer: torch.optim.Optimizer | None, adapters: PeftModel | None) -> int:
    """Load in place; returns the optimizer steps taken when the checkpoint was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    assert optimizer is not None  # only a trainable engine is checkpointed
    model_sd, optim_sd = checkpoint_state(scorer, optimizer, adapters)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory / "engine"))  # fails on any key the checkpoint lacks
    # strict=False with LoRA: the frozen base is not in the state, it stays as loaded from the model directory
    options = StateDictOptions(strict=adapters is None)
    set_state_dict(
        scorer, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
    )
    return json.loads((directory / "engine_state.json").read_text())["steps_taken"]


def checkpoint_state(
    scorer: nn.Module, optimizer: torch.optim.Optimizer | None, adapters: PeftModel | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state as a checkpoint holds them. With LoRA, the adapters
    (and a reward model's value head) and their optimizer state only: the frozen base (tied weights included, which torch's
    `ignore_frozen_params` would keep under their second name) is read from the model
    directory again on resume."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    assert optimizer is not None  # only a trainable engine is checkpointed
    model_sd, optim_sd = get_state_dict(scorer, optimizer)
    if adapters is not None:  # the adapters, and a reward model's head (trained in full beside them)
        model_sd = {name: value for name, value in model_sd.items() if ".lora_" in name or name.startswith(VALUE_HEAD)}
    return model_sd, optim_sd
