"""Built-in synthetic tasks: generated locally, deterministic from the seed, with exact answers.

`addition`: two-digit addition `a+b=` -> `c`. The held-out split is a fixed random subset of the
10,000 problems that never appears in training, so evaluation accuracy measures generalisation,
not memorisation. `data.max_carry_problems` keeps only that many of the training problems whose sum
carries (units or tens): the SFT start learns from the easy problems and a few hard ones, and RL
then generalises to the rest (docs/algorithms.md, "RL that learns"). The same problems give the preference task (chosen = the right sum, rejected =
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

    @property
    def carries(self) -> bool:
        """Whether the sum carries out of the units or out of the tens (a three-digit sum)."""
        return self.a % 10 + self.b % 10 >= 10 or self.a // 10 + self.b // 10 >= 10


def addition_split(
    seed: int, num_eval: int, num_train: int = 0, max_carry: int | None = None
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems; disjoint; `num_train=0` keeps every problem not held out; `max_carry`
    keeps the first that many training problems that carry (and every one that does not)."""
    problems = [Problem(a, b) for a in range(100) for b in range(100)]
    rng = random.Random(seed)
    rng.shuffle(problems)
    if not 0 < num_eval < len(problems):
        raise ValueError(f"data.num_eval={num_eval} must be between 1 and {len(problems) - 1} for the addition task")
    eval_set, train_set = problems[:num_eval], problems[num_eval:]
    if num_train:
        train_set = train_set[:num_train]
    if max_carry is not None:
        carrying = [p for p in train_set if p.carries][:max_carry]
        kept = set(carrying)
        train_set = [p for p in train_set if not p.carries or p in kept]
    return train_set, eval_set


def builtin_split(data_cfg, seed: int) -> tuple[list[Problem], list[Problem]]:
    """The built-in task's (train, eval) problems as `data.*` selects them."""
    return TASKS[data_cfg.task](seed, data_cfg.num_eval, data_cfg.num_train, data_cfg.max_carry_problems)


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
