"""The scorer's side of context parallelism: one rectangle's model call on this rank's slice.

The scorer (rltrain/backends/fsdp/hf_scoring.py) asks `SequenceSplit` for the hidden states of the
scored positions this rank holds and a `gather` that turns per-position results (log-probs,
entropies, values) into the whole rectangle's, so the output head only ever sees this rank's
positions, chunked as at cp=1. docs/long-sequences.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from rltrain.backends.fsdp.context_parallel.split import GatherScored, slice_rectangle
from rltrain.backends.fsdp.context_parallel.ulysses import CP_KWARG
from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle


class CPGroupSource(Protocol):
    """Where the live cp group is read (rltrain.backends.fsdp.groups.FSDPGroups: re-created by time sharing)."""

    @property
    def cp_group(self) -> dist.ProcessGroup: ...


class SequenceSplit:
    """This rank's place in its cp group (`size` ranks, contiguous global ranks)."""

    def __init__(self, groups: CPGroupSource, size: int, cp_rank: int) -> None:
        self.groups, self.size, self.cp_rank = groups, size, cp_rank

    def hidden(self, inner: nn.Module, rect: Rectangle, order_N: torch.Tensor | None) -> tuple[torch.Tensor, Positions]:
        """(final hidden states [n, H] of the scored positions on this rank's slice, in the
        rectangle's order; how per-position tensors map between them and the ragged [N])."""
        group = self.groups.cp_group
        call = slice_rectangle(rect, self.cp_rank, self.size, group)
        out = inner(
            input_ids=call.input_ids_BL, position_ids=call.position_ids_BL, use_cache=False, **{CP_KWARG: call.attention}
        )
        hidden_nH = out.last_hidden_state[call.rows_n, call.cols_n]
        return hidden_nH, Positions(call.owner_N, order_N, self.cp_rank, self.size, group)


class AllPositions:
    """Every scored position is this rank's (no context parallelism): both maps are the identity."""

    def local(self, values_N: torch.Tensor) -> torch.Tensor:
        return values_N

    def gather(self, values_N: torch.Tensor) -> torch.Tensor:
        return values_N


@dataclass
class Positions:
    """Under context parallelism: `local` takes a ragged [N] (the targets) to this rank's [n];
    `gather` takes per-position results [n] to the ragged [N] on every cp rank (collective)."""

    owner_N: torch.Tensor  # the cp rank scoring each position, in the rectangle's order
    order_N: torch.Tensor | None  # rectangle order -> ragged order (None: the same)
    cp_rank: int
    size: int
    group: dist.ProcessGroup

    def local(self, values_N: torch.Tensor) -> torch.Tensor:
        if self.order_N is not None:
            in_rect_N = torch.empty_like(values_N)
            in_rect_N[self.order_N] = values_N
            values_N = in_rect_N
        return values_N[self.owner_N == self.cp_rank]

    def gather(self, values_n: torch.Tensor) -> torch.Tensor:
        full_N = GatherScored.apply(values_n, self.owner_N, self.cp_rank, self.size, self.group)
        return full_N[self.order_N] if self.order_N is not None else full_N
