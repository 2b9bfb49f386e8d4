"""The batch that crosses the algorithm / backend seam.

A `SequenceBatch` is a ragged set of token sequences, each a prompt followed by a completion.
Backends score only completion tokens: the log-probability of completion token j is taken from
the logits at the position before it, so a sequence with prompt length P and total length L
yields L - P log-probabilities. Anything else a loss needs per sequence or per completion token
(advantages, reference or old log-probabilities, pair indices) rides along in `extras`, already
sliced to this batch's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.data.ragged import Ragged


@dataclass
class SequenceBatch:
    tokens: Ragged  # int64 token ids, prompt then completion
    prompt_lens: torch.Tensor  # [B] int64, >= 1 for every sequence
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.tokens) != self.prompt_lens.numel():
            raise ValueError("SequenceBatch needs one prompt length per sequence")
        if len(self.tokens) and bool((self.prompt_lens < 1).any()):
            raise ValueError("every sequence needs a prompt of at least one token")

    def __len__(self) -> int:
        return len(self.tokens)

    def completion_lens(self) -> torch.Tensor:
        return self.tokens.lengths() - self.prompt_lens

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_lens().sum())

    @staticmethod
    def from_lists(prompts: list[list[int]], completions: list[list[int]], **extras: Any) -> SequenceBatch:
        seqs = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(prompts, completions, strict=True)]
        tokens = Ragged.from_list(seqs) if seqs else Ragged(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        return SequenceBatch(tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long), dict(extras))

    def select(self, indices: list[int]) -> SequenceBatch:
        """The sequences at `indices`; per-sequence extras (tensors with B rows, Ragged) follow."""
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
        return SequenceBatch(tokens, self.prompt_lens[idx], extras)
