"""DAPO's dynamic sampling: which groups carry signal (rewards not all equal), which of them one
rank trains on, and the rounds that sample more until it has enough (`run_rounds`; the collector,
rltrain/algos/rl/experience.py `collect_signal`, supplies the sampling and assembles the batch).
docs/algorithms.md ("Dynamic sampling") has the rule and why a short batch is filled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rltrain.data.prompt_data import PromptRow
from rltrain.rewards.scoring import Failures, Scored
from rltrain.rollout.base import Completion
from rltrain.runtime.distributed import global_max


def groups_with_signal(scores_B: torch.Tensor, group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive rewards: do they differ? A group whose rewards are all
    equal has zero group-relative advantage, so it adds no policy gradient, only tokens to the mean."""
    scores_GK = scores_B.view(-1, group_size)
    return (scores_GK != scores_GK[:, :1]).any(dim=1).tolist()


@dataclass
class SamplingRounds:
    """What dynamic sampling did for one step on one rank: rounds run, groups without signal left
    out, and groups without signal trained on anyway because the rounds ran out (zero advantage)."""

    rounds: int
    dropped: int
    filled: int


@dataclass
class _Group:
    row: PromptRow
    completions: list[Completion]
    per_fn: dict[str, list[float]]
    scores_B: torch.Tensor


class SignalGroups:
    """Collects, in the order offered, the first `wanted` groups with signal; keeps the others in
    case the rounds run out. `batch()` returns them laid out as one round's would be."""

    def __init__(self, wanted: int, group_size: int) -> None:
        self.wanted, self.group_size = wanted, group_size
        self.kept: list[_Group] = []
        self.spare: list[_Group] = []
        self.failures = Failures()
        self.filled = 0

    @property
    def missing(self) -> int:
        return self.wanted - len(self.kept)

    @property
    def dropped(self) -> int:
        return len(self.spare) - self.filled

    def offer(self, rows: list[PromptRow], completions: list[Completion], scored: Scored) -> None:
        """One round's groups: `group_size` completions per row, in row order, and their rewards."""
        k = self.group_size
        self.failures = Failures(self.failures.timeouts + scored.failures.timeouts, self.failures.errors + scored.failures.errors)
        for g, signal in enumerate(groups_with_signal(scored.scores_B, k)):
            span = slice(g * k, (g + 1) * k)
            group = _Group(rows[g], completions[span], {n: v[span] for n, v in scored.per_fn.items()}, scored.scores_B[span])
            (self.kept if signal and self.missing > 0 else self.spare).append(group)

    def batch(self) -> tuple[list[PromptRow], list[Completion], Scored]:
        """The kept groups, filled from the spare ones when short: rows, completions renumbered to
        their row, and the rewards in the same order."""
        self.filled = max(0, self.missing)
        groups = self.kept + self.spare[: self.filled]
        rows = [g.row for g in groups]
        completions = [replace(c, prompt_index=i) for i, g in enumerate(groups) for c in g.completions]
        names = list(groups[0].per_fn) if groups else []
        per_fn = {n: [v for g in groups for v in g.per_fn[n]] for n in names}
        scores_B = torch.cat([g.scores_B for g in groups]) if groups else torch.zeros(0, dtype=torch.float64, device="cpu")
        return rows, completions, Scored(per_fn, self.failures, scores_B)


def run_rounds(
    picker: SignalGroups, rows: list[PromptRow], completions: list[Completion], max_rounds: int,
    score: Callable[[list[PromptRow], list[Completion]], Scored], rows_of: Callable[[list[int]], list[PromptRow]],
    more: Callable[[int], tuple[list[int], list[Completion]]],
) -> tuple[list[int], int]:
    """Offers `picker` the first round (`rows`, `completions`), then round r's prompts and
    completions (`more(r)`, rows `rows_of(prompts)`), until this rank holds its share of groups
    with signal or `max_rounds` rounds ran. A collective: every rank takes as many rounds as the
    rank that needs the most. Returns the later rounds' prompts (global indices) and the rounds run."""
    rounds, later = 1, list[int]()
    while True:
        picker.offer(rows, completions, score(rows, completions))
        if global_max(float(picker.missing)) <= 0 or rounds >= max_rounds:
            return later, rounds
        round_index, completions = more(rounds)
        later += round_index
        rows = rows_of(round_index)
        rounds += 1
