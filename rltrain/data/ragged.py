"""Ragged tensors: one packed 1-D tensor of values plus sequence offsets.

This is the native shape of every per-token quantity in rltrain (log-probabilities, advantages,
masks, entropies). Sequences of different lengths never get padded to each other's length outside
a kernel call that needs a rectangle, so no padding value can ever enter a sum. `offsets` has one
more entry than there are sequences: sequence `i` is `values[offsets[i]:offsets[i+1]]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Ragged:
    values: torch.Tensor  # [N] packed
    offsets: torch.Tensor  # [B+1] int64, offsets[0] == 0, offsets[-1] == N

    def __post_init__(self) -> None:
        if self.offsets.dim() != 1 or self.offsets.numel() < 1:
            raise ValueError("Ragged offsets must be a 1-D tensor with at least one entry")
        if self.values.shape[0] != int(self.offsets[-1]):
            raise ValueError(
                f"Ragged values hold {self.values.shape[0]} entries but offsets end at {int(self.offsets[-1])}"
            )

    @staticmethod
    def from_lengths(values: torch.Tensor, lengths: Sequence[int] | torch.Tensor) -> Ragged:
        lengths_B = torch.as_tensor(lengths, dtype=torch.long)
        offsets = torch.zeros(lengths_B.numel() + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths_B, 0)
        return Ragged(values, offsets)

    @staticmethod
    def from_list(seqs: Sequence[torch.Tensor]) -> Ragged:
        lengths = [int(s.shape[0]) for s in seqs]
        if seqs:
            values = torch.cat(list(seqs))
        else:
            values = torch.zeros(0)
        return Ragged.from_lengths(values, lengths)

    @staticmethod
    def cat(parts: Sequence[Ragged]) -> Ragged:
        """Concatenate along the sequence axis (e.g. micro-batches or pipeline stages)."""
        if not parts:
            raise ValueError("Ragged.cat needs at least one part")
        lengths = torch.cat([p.lengths() for p in parts])
        return Ragged.from_lengths(torch.cat([p.values for p in parts]), lengths)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.values.shape[0])

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def seq_ids(self) -> torch.Tensor:
        """[N] index of the sequence each value belongs to."""
        return torch.repeat_interleave(torch.arange(len(self)), self.lengths())

    def split(self) -> list[torch.Tensor]:
        return list(torch.split(self.values, self.lengths().tolist()))

    def select(self, indices: Sequence[int] | torch.Tensor) -> Ragged:
        """The sequences at `indices`, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        seqs = self.split()
        return Ragged.from_list([seqs[i] for i in idx.tolist()]) if len(idx) else self.like_empty()

    def like_empty(self) -> Ragged:
        return Ragged(self.values[:0], torch.zeros(1, dtype=torch.long))

    def with_values(self, values: torch.Tensor) -> Ragged:
        """Same layout, other values (e.g. advantages broadcast onto log-probabilities)."""
        return Ragged(values, self.offsets)

    def sum_per_seq(self) -> torch.Tensor:
        """[B] sum of each sequence's values; an empty sequence sums to 0. Differentiable."""
        out = torch.zeros(len(self), dtype=self.values.dtype, device=self.values.device)
        return out.index_add(0, self.seq_ids().to(self.values.device), self.values)

    def mean_per_seq(self) -> torch.Tensor:
        """[B] mean of each sequence's values; an empty sequence has mean 0."""
        lengths = self.lengths().to(self.values.device).clamp(min=1).to(self.values.dtype)
        return self.sum_per_seq() / lengths

    def broadcast(self, per_seq_B: torch.Tensor) -> Ragged:
        """A per-sequence value repeated onto every token of its sequence."""
        return self.with_values(
            torch.repeat_interleave(per_seq_B, self.lengths().to(per_seq_B.device), output_size=self.num_tokens)
        )

    def to_padded(self, pad_value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T] values, [B, T] bool mask). Only for kernels that need a rectangle."""
        lengths = self.lengths()
        max_len = int(lengths.max()) if len(self) else 0
        padded = torch.full((len(self), max_len), pad_value, dtype=self.values.dtype, device=self.values.device)
        mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
        padded[mask.to(padded.device)] = self.values
        return padded, mask

    def detach(self) -> Ragged:
        return Ragged(self.values.detach(), self.offsets)

    def to(self, device: torch.device | str) -> Ragged:
        """The values on `device`; offsets stay on the host (they index, never compute)."""
        return Ragged(self.values.to(device), self.offsets)


def on_device(value, device: torch.device | str):
    """`value` (a tensor, a Ragged, or anything else, returned as is) on `device`."""
    if isinstance(value, (torch.Tensor, Ragged)):
        return value.to(device)
    return value
