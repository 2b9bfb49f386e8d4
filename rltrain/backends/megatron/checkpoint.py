"""Training checkpoints (weights + AdamW moments + step) with torch.distributed.checkpoint.

Each rank saves its own shards under keys prefixed by its (tp, pp) coordinate (a MoE's experts also
by its expert-parallel rank: replicas hold different experts); data-parallel replicas hold identical
tensors under identical keys, which DCP's planner writes once. Loading therefore needs the same tp
and pp (and ep for a MoE; the data-parallel size may differ); they are stored and checked first so
that a mismatch is a clear error, not a missing-key trace. Resharding to
another tp or pp goes through the Hugging Face export instead. Writing to a temporary directory
and renaming it into place is the caller's job.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from rltrain.backends.megatron.convert import is_expert
from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.backends.megatron.optim import ensure_state


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, coords: ParallelCoords) -> dict:
    dense = f"tp{coords.tp_rank}_pp{coords.pp_rank}"
    experts = f"{dense}_ep{coords.ep_rank}"

    def key(name: str) -> str:
        return f"{experts if is_expert(name) else dense}/{name}"

    model_state = {key(name): p.detach() for name, p in model.named_parameters()}
    optim_state: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        ensure_state(optimizer)
        for name, p in model.named_parameters():
            for k, value in optimizer.state[p].items():
                optim_state[f"{key(name)}/{k}"] = value
    return {"model": model_state, "optim": optim_state}


def _meta(step: int, coords: ParallelCoords, moe: bool) -> dict:
    meta = {"step": torch.tensor(step, dtype=torch.long), "layout": torch.tensor([coords.tp, coords.pp])}
    if moe:  # a dense model's checkpoints keep their keys
        meta["ep"] = torch.tensor(coords.ep)
    return {"meta": meta}


def _has_experts(model: torch.nn.Module) -> bool:
    return any(is_expert(name) for name, _ in model.named_parameters())


def save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, coords: ParallelCoords, step: int) -> None:
    state = _state(model, optimizer, coords) | _meta(step, coords, _has_experts(model))
    dcp.save(state, checkpoint_id=str(directory))


def load(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, coords: ParallelCoords) -> int:
    """Load in place; returns the optimizer step the checkpoint was taken at."""
    moe = _has_experts(model)
    meta = _meta(0, coords, moe)
    dcp.load(meta, checkpoint_id=str(directory))
    saved_tp, saved_pp = (int(x) for x in meta["meta"]["layout"])
    saved_ep = int(meta["meta"]["ep"]) if moe else 1
    if (saved_tp, saved_pp, saved_ep) != (coords.tp, coords.pp, coords.ep):
        raise ValueError(
            f"checkpoint {directory} was written with tp={saved_tp}, pp={saved_pp}, ep={saved_ep}; this run has "
            f"tp={coords.tp}, pp={coords.pp}, ep={coords.ep}. Resume with the same tp, pp and ep, or start from its "
            "Hugging Face export."
        )
    state = _state(model, optimizer, coords)
    dcp.load(state, checkpoint_id=str(directory))
    return int(meta["meta"]["step"])
