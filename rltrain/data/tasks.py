"""Built-in synthetic tasks: generated locally, deterministic from the seed, with exact answers.

`addition`: `a+b=` -> the sum, a and b in 0..99; a held-out split never seen in training (drawn
with `data.eval_seed`, or the run's seed when that is null); `data.max_carry_problems` keeps that
many training sums that carry, `data.forgotten_carries` shows that share of them with the units
carry forgotten (docs/algorithms.md, "RL that learns"). `multiplication`: `a*b*c=` -> the product,
beyond the tiny model without the `multiply` tool; TOOL_DEMO_FRACTION of its SFT demonstrations
call it (docs/environments.md). `code`: `f(0)=B;f(10)=V` -> `f=lambda x:A*x+B`, scored by hidden
asserts in the sandbox; its SFT demonstrations slip on a share of the odd B (docs/rewards-and-roles.md).
`colours`: a picture and a question only it answers (rltrain/data/colour_task.py). `reasoning_gym`: rltrain/data/reasoning_gym.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rltrain.config.schema import DataConfig
from rltrain.data.colour_task import NUM_PICTURES, ColourProblem, colour_problems
from rltrain.data.reasoning_gym import GymProblem, reasoning_gym_split
from rltrain.runtime.errors import UserError

TOOL_DEMO_FRACTION = 0.3  # multiplication: SFT demonstrations that call the tool
CODE_SLIP_SHARE = 0.8  # code: SFT demonstrations of an odd intercept that subtract it instead
CODE_HIDDEN_XS = (3, 7, -2)  # code: the hidden cases, f(x) at each


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str = "+"
    c: int = 0  # multiplication's third factor

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}=" if self.op == "+" else f"{self.a}*{self.b}*{self.c}="

    @property
    def value(self) -> int:
        return self.a + self.b if self.op == "+" else self.a * self.b * self.c

    @property
    def answer(self) -> str:
        return str(self.value)

    @property
    def calls_tool(self) -> bool:
        """Whether its SFT demonstration calls the `multiply` tool (a fixed share of the products)."""
        return self.op == "*" and (self.a * 7919 + self.b * 104729 + self.c * 15485863) % 1000 < TOOL_DEMO_FRACTION * 1000

    @property
    def rl_row(self) -> dict:
        """Its row for online RL: the prompt and the column the built-in reward checks against."""
        return {"prompt": self.prompt, "answer": self.answer}

    def demonstration(self, eos: str, forgotten_carries: float = 0.0) -> str:
        """The SFT completion: the answer, or two tool calls (a*b, then that times c), each followed
        by its result, then the answer. `eos` ends each call turn, as the engine's stop token does.
        A sum is shown with its units carry forgotten when `forgets_carry(forgotten_carries)`."""
        if self.forgets_carry(forgotten_carries):
            return self.forgotten_carry_answer
        if not self.calls_tool:
            return self.answer
        turns = []
        for x, y in ((self.a, self.b), (self.a * self.b, self.c)):
            call = json.dumps({"name": "multiply", "arguments": {"a": x, "b": y}})
            turns.append(f"<tool_call>{call}</tool_call>{eos}<tool_response>{x * y}</tool_response>")
        return "".join(turns) + self.answer

    @property
    def carries(self) -> bool:
        """Whether the sum carries out of the units or out of the tens (a three-digit sum)."""
        return self.op == "+" and (self.a % 10 + self.b % 10 >= 10 or self.a // 10 + self.b // 10 >= 10)

    @property
    def carries_from_units(self) -> bool:
        """Whether the units column carries into the tens (the carry `data.forgotten_carries` drops)."""
        return self.op == "+" and self.a % 10 + self.b % 10 >= 10

    @property
    def forgotten_carry_answer(self) -> str:
        """The sum with the carry out of the units not added to the tens: 17+25 -> 32, 95+17 -> 102."""
        return str(self.value - 10)

    def forgets_carry(self, share: float) -> bool:
        """Whether this sum is among `share` of the sums that carry out of the units whose
        demonstration forgets that carry: a fixed pseudo-random draw per sum (the same on every run
        and seed, and no pattern of a and b that a model could learn instead of the carry)."""
        return share > 0 and self.carries_from_units and random.Random(f"{self.a}+{self.b}").random() < share


@dataclass(frozen=True)
class CodeProblem:
    """Write `f` from two of its values: `f(0)=7;f(10)=237` -> `f=lambda x:23*x+7` (slope 1..99,
    intercept 0..9, so f(10) spells both). Hidden cases, never in the prompt: f(x) at CODE_HIDDEN_XS."""

    slope: int
    intercept: int

    @property
    def prompt(self) -> str:
        return f"f(0)={self.intercept};f(10)={10 * self.slope + self.intercept}\n"

    @property
    def answer(self) -> str:
        """The reference solution (what SFT's exact-match evaluation compares a greedy reply with)."""
        return f"f=lambda x:{self.slope}*x+{self.intercept}"

    @property
    def slips(self) -> bool:
        """Whether its SFT demonstration subtracts the intercept: CODE_SLIP_SHARE of the odd
        intercepts, a fixed pseudo-random draw per problem (the same on every run and seed)."""
        odd = self.intercept % 2 == 1
        return odd and random.Random(f"code {self.slope} {self.intercept}").random() < CODE_SLIP_SHARE

    def demonstration(self, eos: str, forgotten_carries: float = 0.0) -> str:
        """The SFT completion: the reference, or with the slip `-B` (`forgotten_carries` is addition's)."""
        return self.answer.replace("+", "-") if self.slips else self.answer

    @property
    def tests(self) -> list[str]:
        """The hidden cases, one assert each (the `test` layout of rltrain.rewards.code:tests_pass)."""
        return [f"assert f({x}) == {self.slope * x + self.intercept}" for x in CODE_HIDDEN_XS]

    @property
    def rl_row(self) -> dict:
        """Its row for online RL: the prompt and its hidden cases (no `answer`: any right code passes)."""
        return {"prompt": self.prompt, "test": self.tests}


BuiltinProblem = Problem | CodeProblem | ColourProblem | GymProblem
PairedProblem = Problem | ColourProblem  # the tasks with preference pairs: a wrong answer to reject
P = TypeVar("P", Problem, CodeProblem, ColourProblem)


def held_out(problems: list[P], seed: int, num_eval: int, eval_seed: int | None) -> tuple[list[P], list[P]]:
    """(eval, train): the first `num_eval` of a shuffle by `eval_seed` (a held-out set that is the same
    for every run seed), the rest in the run seed's order; with `eval_seed` null one shuffle by
    `seed` draws both."""
    if not 0 < num_eval < len(problems):
        raise ValueError(f"data.num_eval={num_eval} must be between 1 and {len(problems) - 1}")
    problems = list(problems)
    random.Random(seed if eval_seed is None else eval_seed).shuffle(problems)
    eval_set, train_set = problems[:num_eval], problems[num_eval:]
    if eval_seed is not None:
        random.Random(seed).shuffle(train_set)
    return eval_set, train_set


def addition_split(
    seed: int, num_eval: int, num_train: int = 0, max_carry: int | None = None, eval_seed: int | None = None
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems; disjoint; `num_train=0` keeps every problem not held out; `max_carry`
    keeps the first that many training problems that carry (and every one that does not)."""
    eval_set, train_set = held_out([Problem(a, b) for a in range(100) for b in range(100)], seed, num_eval, eval_seed)
    if num_train:
        train_set = train_set[:num_train]
    if max_carry is not None:
        carrying = [p for p in train_set if p.carries][:max_carry]
        kept = set(carrying)
        train_set = [p for p in train_set if not p.carries or p in kept]
    return train_set, eval_set


def multiplication_split(
    seed: int, num_eval: int, num_train: int = 0, max_carry: int | None = None, eval_seed: int | None = None
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) products a*b*c; disjoint (`max_carry` is addition's: refused by the config check)."""
    problems = [Problem(a, b, "*", c) for a in range(10, 100) for b in range(10, 100) for c in range(2, 10)]
    eval_set, train_set = held_out(problems, seed, num_eval, eval_seed)
    return (train_set[:num_train] if num_train else train_set), eval_set


def colours_split(
    seed: int, num_eval: int, num_train: int = 0, max_carry: int | None = None, eval_seed: int | None = None
) -> tuple[list[ColourProblem], list[ColourProblem]]:
    """(train, eval) pictures; disjoint (`max_carry` is addition's: refused by the config check)."""
    eval_set, train_set = held_out(colour_problems(), seed, num_eval, eval_seed)
    return (train_set[:num_train] if num_train else train_set), eval_set


def code_split(
    seed: int, num_eval: int, num_train: int = 0, max_carry: int | None = None, eval_seed: int | None = None
) -> tuple[list[CodeProblem], list[CodeProblem]]:
    """(train, eval) functions to write; disjoint (`max_carry` is addition's: refused by the config check)."""
    problems = [CodeProblem(a, b) for a in range(1, 100) for b in range(10)]
    eval_set, train_set = held_out(problems, seed, num_eval, eval_seed)
    return (train_set[:num_train] if num_train else train_set), eval_set


def gym_split(
    seed: int, num_eval: int, num_train: int = 0, max_carry: int | None = None, eval_seed: int | None = None, tasks: Sequence = ()
) -> tuple[list[GymProblem], list[GymProblem]]:
    """(train, eval) of reasoning-gym's generators named by `data.tasks` (`max_carry` is addition's: refused)."""
    return reasoning_gym_split(list(tasks), seed, num_eval, num_train, eval_seed)


def image_column(problem: BuiltinProblem) -> dict[str, list]:
    """The row's `images` column: a visual task's picture, nothing for the text tasks."""
    return {"images": problem.images} if isinstance(problem, ColourProblem) else {}


def builtin_split(data_cfg: DataConfig, seed: int) -> tuple[list[BuiltinProblem], list[BuiltinProblem]]:
    """The built-in task's (train, eval) problems as `data.*` selects them (`data=reasoning_gym`: the
    generators of `data.tasks`, rltrain/data/reasoning_gym.py)."""
    extra = {"tasks": list(data_cfg.tasks)} if data_cfg.task == "reasoning_gym" else {}
    train, held = TASKS[data_cfg.task](seed, data_cfg.num_eval, data_cfg.num_train, data_cfg.max_carry_problems, data_cfg.eval_seed, **extra)
    return list(train), list(held)


def answer_split(data_cfg: DataConfig, seed: int) -> tuple[list[PairedProblem], list[PairedProblem]]:
    """`builtin_split` for the tasks with a wrong answer to reject (numbers, colours): the preference pairs."""
    train, held = builtin_split(data_cfg, seed)
    paired = [p for p in train + held if isinstance(p, Problem | ColourProblem)]
    if len(paired) != len(train) + len(held):
        raise UserError(NO_CODE_PAIRS.format(task=data_cfg.task))
    return paired[: len(train)], paired[len(train) :]


NO_CODE_PAIRS = (
    "data.task={task!r} has no preference pairs or labelled completions (its answers are code, checked by running "
    "them): use it with algo=sft, grpo or ppo, or pick data.task=addition, multiplication or colours."
)


def wrong_answer(problem: Problem, rng: random.Random, same_length: float = 0.0) -> str:
    """A wrong sum whose length differs from the right one (so chosen and rejected are ragged); with
    probability `same_length` (`data.same_length_rejected`) instead one of the right length, one digit
    changed: a pair that only the sum itself tells apart, not the answer's length."""
    right = problem.value
    if same_length > 0 and rng.random() < same_length:
        return one_digit_changed(str(right), rng)
    while True:
        digits = rng.choice([d for d in (1, 2, 3, 4) if d != len(str(right))])
        low = 0 if digits == 1 else 10 ** (digits - 1)
        candidate = rng.randrange(low, 10**digits)
        if candidate != right:
            return str(candidate)


def one_digit_changed(answer: str, rng: random.Random) -> str:
    """`answer` with one digit, drawn uniformly, replaced by another (a leading digit by a non-zero one)."""
    at = rng.randrange(len(answer))
    allowed = [d for d in "0123456789" if d != answer[at] and not (at == 0 and len(answer) > 1 and d == "0")]
    return answer[:at] + rng.choice(allowed) + answer[at + 1 :]


def sft_rows(
    problems: list[BuiltinProblem], eos: str, demonstrations: bool = True, forgotten_carries: float = 0.0
) -> list[dict]:
    """Prompt / completion rows: the demonstrations (training), or the bare answers (held out: what
    SFT's exact-match evaluation compares a greedy reply with)."""
    return [
        {"prompt": p.prompt, "completion": p.demonstration(eos, forgotten_carries) if demonstrations else p.answer,
         **image_column(p)}
        for p in problems
    ]


def preference_rows(problems: list[PairedProblem], seed: int, same_length: float = 0.0) -> list[dict]:
    rng = random.Random(seed + 1)
    return [
        {"prompt": p.prompt, "chosen": p.answer, **image_column(p),
         "rejected": p.wrong_answer(rng) if isinstance(p, ColourProblem) else wrong_answer(p, rng, same_length)}
        for p in problems
    ]


def prompt_rows(problems: list[BuiltinProblem]) -> list[dict]:
    """Rows for online RL: the prompt and the columns the built-in reward reads."""
    return [p.rl_row for p in problems]


Split = Callable[..., tuple[Sequence[BuiltinProblem], Sequence[BuiltinProblem]]]
TASKS: dict[str, Split] = {"addition": addition_split, "multiplication": multiplication_split, "code": code_split,
                         "colours": colours_split, "reasoning_gym": gym_split}
TASK_SIZES = {"addition": 10_000, "multiplication": 64_800, "code": 990, "colours": NUM_PICTURES}
