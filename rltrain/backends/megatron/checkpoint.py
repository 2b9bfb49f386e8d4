"""Training checkpoints (weights + AdamW moments + step) with torch.distributed.checkpoint.

Each rank saves its own shards under keys prefixed by its (tp, pp) coordinate; data-parallel
replicas hold identical tensors under identical keys, which DCP's planner writes once. Loading
therefore needs the same tp and pp (the data-parallel size may differ); tp and pp are stored
and checked first so that a mismatch is a clear error, not a missing-key trace. Resharding to
another tp or pp goes through the Hugging Face export instead. Writing to a temporary directory
and renaming it into place is the caller's job.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.backends.megatron.optim import ensure_state


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, coords: ParallelCoords) -> dict:
    prefix = f"tp{coords.tp_rank}_pp{coords.pp_rank}"
    model_state = {f"{prefix}/{name}": p.detach() for name, p in model.named_parameters()}
    optim_state: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        ensure_state(optimizer)
        for name, p in model.named_parameters():
            for key, value in optimizer.state[p].items():
                optim_state[f"{prefix}/{name}/{key}"] = value
    return {"model": model_state, "optim": optim_state}


def _meta(step: int, coords: ParallelCoords) -> dict:
    return {"meta": {"step": torch.tensor(step, dtype=torch.long), "layout": torch.tensor([coords.tp, coords.pp])}}


def save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, coords: ParallelCoords, step: int) -> None:
    state = _state(model, optimizer, coords) | _meta(step, coords)
    dcp.save(state, checkpoint_id=str(directory))


def load(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, coords: ParallelCoords) -> int:
    """Load in place; returns the optimizer step the checkpoint was taken at."""
    meta = _meta(0, coords)
    dcp.load(meta, checkpoint_id=str(directory))
    saved_tp, saved_pp = (int(x) for x in meta["meta"]["layout"])
    if (saved_tp, saved_pp) != (coords.tp, coords.pp):
        raise ValueError(
            f"checkpoint {directory} was written with tp={saved_tp}, pp={saved_pp}; this run has "
            f"tp={coords.tp}, pp={coords.pp}. Resume with the same tp and pp, or start from its "
            "Hugging Face export."
        )
    state = _state(model, optimizer, coords)
    dcp.load(state, checkpoint_id=str(directory))
    return int(meta["meta"]["step"])
