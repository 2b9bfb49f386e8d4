"""The batch that crosses the algorithm / backend seam.

A `SequenceBatch` is a ragged set of token sequences, each a prompt followed by a completion.
Backends score only completion tokens: the log-probability of completion token j is taken from
the logits at the position before it, so a sequence with prompt length P and total length L
yields L - P log-probabilities. What else a loss needs rides along, sliced to this batch's
sequences: a typed `loss_inputs` (rltrain/algos/rl/update.py), the string-keyed `extras` (SFT's
and DPO's counts), and `sampled`: which completion tokens the policy sampled, where a multi-turn
episode interleaves observations (docs/environments.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rltrain.data.ragged import Ragged


class LossInputs(Protocol):
    """Per-sequence inputs of a loss that follow the sequences when a batch is split."""

    def select(self, indices: torch.Tensor) -> LossInputs:
        """The inputs of the sequences at `indices`, in that order."""


@dataclass
class SequenceBatch:
    tokens: Ragged  # int64 token ids, prompt then completion
    prompt_lens: torch.Tensor  # [B] int64, >= 1 for every sequence
    extras: dict[str, Any] = field(default_factory=dict)
    loss_inputs: LossInputs | None = None
    sampled: Ragged | None = None  # bool per completion token: sampled by the policy; None = every one
    # The rollout engine's experts per completion token, values [N, layers, k] int16, -1 where none
    # was recorded; what router replay routes by (docs/moe.md). None: the engine recorded none.
    routing: Ragged | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != self.prompt_lens.numel():
            raise ValueError("SequenceBatch needs one prompt length per sequence")
        if len(self.tokens) and bool((self.prompt_lens < 1).any()):
            raise ValueError("every sequence needs a prompt of at least one token")
        if self.sampled is not None and not torch.equal(self.sampled.lengths(), self.completion_lens()):
            raise ValueError("SequenceBatch.sampled needs one flag per completion token")
        if self.routing is not None and not torch.equal(self.routing.lengths(), self.completion_lens()):
            raise ValueError("SequenceBatch.routing needs one routing per completion token")

    def __len__(self) -> int:
        return len(self.tokens)

    def completion_lens(self) -> torch.Tensor:
        return self.tokens.lengths() - self.prompt_lens

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_lens().sum())

    @property
    def num_sampled_tokens(self) -> int:
        """Completion tokens the policy sampled (what a policy loss averages over)."""
        return self.num_completion_tokens if self.sampled is None else int(self.sampled.values.sum())

    @staticmethod
    def from_lists(prompts: list[list[int]], completions: list[list[int]], **extras: Any) -> SequenceBatch:
        seqs = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(prompts, completions, strict=True)]
        tokens = Ragged.from_list(seqs) if seqs else Ragged(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        return SequenceBatch(tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long), dict(extras))

    def select(self, indices: list[int]) -> SequenceBatch:
        """The sequences at `indices`; `loss_inputs` and per-sequence extras (tensors with B rows,
        Ragged) follow."""
        n = len(self)
        idx = torch.as_tensor(indices, dtype=torch.long)
        extras: dict[str, Any] = {}
        for key, value in self.extras.items():
            if isinstance(value, Ragged):
                extras[key] = value.select(idx)
            elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
                extras[key] = value[idx]
            elif isinstance(value, list) and len(value) == n:
                extras[key] = [value[i] for i in idx.tolist()]
            else:
                extras[key] = value
        tokens = self.tokens.select(idx) if len(idx) else Ragged(
            torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        )
        inputs = self.loss_inputs.select(idx) if self.loss_inputs is not None else None
        sampled = self.sampled.select(idx) if self.sampled is not None else None
        routing = self.routing.select(idx) if self.routing is not None else None
        return SequenceBatch(tokens, self.prompt_lens[idx], extras, inputs, sampled, routing)


def length_buckets(lengths: list[int], bucket_cost_tokens: int) -> list[list[int]]:
    """Split sequence indices into groups of similar length so that padding each group to its own
    longest sequence wastes little compute.

    Why: a right-padded rectangle of B sequences costs B * max_len tokens of compute; with lengths
    spread 30-250 that is close to twice the real tokens. Each extra group costs one more model
    call (`bucket_cost_tokens`: kernel launches and per-call overhead, expressed in tokens). An
    exact dynamic programme over the lengths sorted longest-first minimises
    `sum(group padded tokens) + groups * bucket_cost_tokens`; ties keep the original order, so the
    result is deterministic. Returns groups of original indices, longest group first.
    """
    n = len(lengths)
    if n <= 1:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    sorted_len = [lengths[i] for i in order]
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest cost of the first j sorted sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group is sorted[i:j], padded to sorted_len[i]
            cost = best[i] + bucket_cost_tokens + sorted_len[i] * (j - i)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        i = cut[j]
        groups.append(order[i:j])
        j = i
    groups.reverse()
    return groups
