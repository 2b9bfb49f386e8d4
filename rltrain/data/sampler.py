"""A deterministic, resumable stream of example indices.

Each epoch is a fresh permutation drawn from (seed, epoch); the position is two integers, saved in
every checkpoint, so a resumed run draws exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import torch


class IndexStream:
    def __init__(self, num_examples: int, seed: int) -> None:
        if num_examples <= 0:
            raise ValueError("IndexStream needs at least one example")
        self.num_examples = num_examples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_examples, generator=gen).tolist()

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position == self.num_examples:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            n = min(count - len(out), self.num_examples - self.position)
            out.extend(self._order[self.position : self.position + n])
            self.position += n
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
