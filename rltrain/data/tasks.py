"""Built-in synthetic tasks: generated locally, deterministic from the seed, with exact answers.

`addition`: two-digit addition `a+b=` -> `c`. The held-out split is a fixed random subset of the
10,000 problems that never appears in training, so evaluation accuracy measures generalisation,
not memorisation. The same problems give the preference task (chosen = the right sum, rejected =
a wrong one of a different length) and the reward for online RL (see rltrain/rewards/builtin.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def addition_split(seed: int, num_eval: int, num_train: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems; disjoint; `num_train=0` keeps every problem not held out."""
    problems = [Problem(a, b) for a in range(100) for b in range(100)]
    rng = random.Random(seed)
    rng.shuffle(problems)
    if not 0 < num_eval < len(problems):
        raise ValueError(f"data.num_eval={num_eval} must be between 1 and {len(problems) - 1} for the addition task")
    eval_set, train_set = problems[:num_eval], problems[num_eval:]
    if num_train:
        train_set = train_set[:num_train]
    return train_set, eval_set


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A wrong sum whose length differs from the right one (so chosen and rejected are ragged)."""
    right = problem.a + problem.b
    while True:
        digits = rng.choice([d for d in (1, 2, 3, 4) if d != len(str(right))])
        low = 0 if digits == 1 else 10 ** (digits - 1)
        candidate = rng.randrange(low, 10**digits)
        if candidate != right:
            return str(candidate)


def sft_rows(problems: list[Problem]) -> list[dict[str, str]]:
    return [{"prompt": p.prompt, "completion": p.answer} for p in problems]


def preference_rows(problems: list[Problem], seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed + 1)
    return [{"prompt": p.prompt, "chosen": p.answer, "rejected": wrong_answer(p, rng)} for p in problems]


def prompt_rows(problems: list[Problem]) -> list[dict[str, str]]:
    """Rows for online RL: the prompt and the column the built-in reward checks against."""
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems]


TASKS = {"addition": addition_split}
