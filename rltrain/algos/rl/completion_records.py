"""What completions carry beside their tokens, as one packed tensor for a batch: which tokens the
policy sampled (multi-turn rollouts interleave observations) and the engine's recorded experts per
token (router replay, docs/moe.md)."""

from __future__ import annotations

import torch

from rltrain.data.ragged import Ragged
from rltrain.models.moe import ROUTING_DTYPE
from rltrain.rollout.base import Completion


def sampled_mask(completions: list[Completion]) -> Ragged | None:
    """Which completion tokens the policy sampled, where a multi-turn rollout interleaved
    observations (None: a single-turn batch, every token sampled)."""
    if all(c.sampled is None for c in completions):
        return None
    flags = [c.sampled if c.sampled is not None else [True] * len(c.token_ids) for c in completions]
    return Ragged.from_lengths(
        torch.tensor([f for fs in flags for f in fs], dtype=torch.bool, device="cpu"),
        torch.tensor([len(fs) for fs in flags], dtype=torch.long, device="cpu"),
    )


def recorded_routing(completions: list[Completion]) -> Ragged | None:
    """The engine's experts per completion token ([N, layers, k], -1 for a completion without a
    record), where it recorded any (rollout=hf on a MoE: docs/moe.md, "Router replay")."""
    shapes = [c.routing.shape[1:] for c in completions if c.routing is not None and c.routing.numel()]
    if not shapes:
        return None
    shape = shapes[0]
    device = next(c.routing.device for c in completions if c.routing is not None and c.routing.numel())
    parts = [
        c.routing if c.routing is not None and c.routing.numel()
        else torch.full((len(c.token_ids), *shape), -1, dtype=ROUTING_DTYPE, device=device)
        for c in completions
    ]
    return Ragged.from_lengths(torch.cat(parts), [len(c.token_ids) for c in completions])
