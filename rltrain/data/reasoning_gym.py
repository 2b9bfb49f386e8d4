"""`data=reasoning_gym`: prompts from reasoning-gym's procedural generators, offline and seeded.

`data.tasks` names the generators (`[chain_sum, ...]`, or `{name: chain_sum, weight: 2, size: 500,
seed: 3, min_terms: 2}` with any of the generator's own config keys). Every row carries what its
dataset's own `score_answer` needs to be called again in a reward worker: the task, its generator
config and the row's index (the generators are deterministic from seed and index), so the reward is
the package's verifier with nothing to write (rltrain/rewards/reasoning_gym.py). The held-out
problems come from a generator of their own seed and are removed from the training rows by their
question text. docs/environments.md, "reasoning-gym".
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rltrain.config.plain_values import plain
from rltrain.runtime.errors import UserError, require_extra

INSTALL = "reasoning-gym==0.1.25"
RLTRAIN_KEYS = ("name", "weight", "eval_size")  # an entry's keys that are ours; the rest go to the generator
EVAL_SEED_OFFSET = 1_000_003  # a task's held-out generator seed: its training seed plus this (or data.eval_seed)


def require_reasoning_gym() -> None:
    """One paragraph naming the install command when the package is missing."""
    require_extra("reasoning_gym", "data=reasoning_gym needs the reasoning-gym package", INSTALL, "reasoning-gym", "choose other data")


@dataclass(frozen=True)
class TaskSpec:
    """One `data.tasks` entry: the generator, its share of the training prompts, its held-out size
    and the generator's config (its `seed` and `size` included)."""

    name: str
    weight: float
    eval_size: int
    config: tuple[tuple[str, Any], ...]

    @property
    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)


def task_specs(tasks: list[Any], seed: int, num_eval: int) -> list[TaskSpec]:
    """`data.tasks` read and checked against the package: unknown names and config keys are one
    paragraph each. A task's seed defaults to `seed` (the run's), its held-out size to an even
    share of `data.num_eval`."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if not tasks:
        raise UserError("data=reasoning_gym needs data.tasks=[NAME, ...]: the reasoning-gym generators to train on (e.g. data.tasks=[chain_sum]).")
    specs = []
    for entry in tasks:
        spec = dict(entry) if isinstance(entry, Mapping) else {"name": entry}
        name = str(spec.get("name"))
        if name not in DATASETS:
            close = [n for n in sorted(DATASETS) if n[:3] == name[:3]][:5]
            raise UserError(
                f"data.tasks names {name!r}, which is not a reasoning-gym dataset"
                f"{' (close: ' + ', '.join(close) + ')' if close else ''}. The {len(DATASETS)} names are those of "
                "`reasoning_gym.factory.DATASETS`; give each entry as NAME or {name: NAME, weight: W, size: N, seed: S, <its config keys>}."
            )
        config = {k: plain(v) for k, v in spec.items() if k not in RLTRAIN_KEYS}
        config.setdefault("seed", seed)
        weight = float(spec.get("weight", 1.0))
        eval_size = int(spec.get("eval_size", max(1, num_eval // len(tasks))))
        if weight < 0 or eval_size < 1:
            raise UserError(f"data.tasks {name!r}: weight={weight} must be >= 0 and eval_size={eval_size} >= 1.")
        try:
            _dataset(name, json.dumps(config, sort_keys=True))
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"data.tasks {name!r}: reasoning-gym refused its config {config} ({type(exc).__name__}: {exc}). "
                f"Its config keys are those of {DATASETS[name][1].__name__} (seed and size included)."
            ) from exc
        specs.append(TaskSpec(name, weight, eval_size, tuple(sorted(config.items()))))
    if len({s.name for s in specs}) < len(specs):
        raise UserError(f"data.tasks names a task twice ({[s.name for s in specs]}): give each once, with its weight.")
    if not any(s.weight > 0 for s in specs):
        raise UserError("data.tasks: every weight is 0; give at least one task a positive weight.")
    return specs


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str):
    """The package's dataset for a config; cached per process (reward workers score many rows of one)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config_json))


def entry_of(task: str, config_json: str, index: int) -> tuple[Any, dict[str, Any]]:
    """(dataset, entry): a row's problem generated again from its task, config and index."""
    dataset = _dataset(task, config_json)
    return dataset, dataset[index]


@dataclass(frozen=True)
class GymProblem:
    """One generated problem: what the data pipeline needs (prompt, answer, rows) and where it came from."""

    task: str
    config_json: str
    index: int
    prompt: str
    answer: str

    @property
    def rl_row(self) -> dict:
        return {"prompt": self.prompt, "answer": self.answer, "rg_task": self.task, "rg_config": self.config_json, "rg_index": self.index}

    @property
    def calls_tool(self) -> bool:
        return False

    def demonstration(self, eos: str, forgotten_carries: float = 0.0) -> str:
        """The SFT completion: the package's own answer."""
        return self.answer


def _problems(name: str, config: dict[str, Any]) -> list[GymProblem]:
    config_json = json.dumps(config, sort_keys=True)
    dataset = _dataset(name, config_json)
    out = []
    for i in range(len(dataset)):
        entry = dataset[i]
        out.append(GymProblem(name, config_json, i, str(entry["question"]), str(entry["answer"])))
    return out


def reasoning_gym_split(tasks: list[Any], seed: int, num_eval: int, num_train: int, eval_seed: int | None) -> tuple[list[GymProblem], list[GymProblem]]:
    """(train, eval): each task's held-out problems (its generator at another seed, `eval_size`
    of them) and its training problems without any held-out question; the training list is
    `num_train` prompts (0: every task's problems once) drawn task by task in proportion to the
    weights, each task's problems in a seeded order, cycled."""
    specs = task_specs(tasks, seed, num_eval)
    held: list[GymProblem] = []
    pools: list[list[GymProblem]] = []
    for spec in specs:
        config = spec.config_dict
        task_seed = int(config["seed"])
        held_config = {**config, "size": spec.eval_size, "seed": (eval_seed if eval_seed is not None else task_seed) + EVAL_SEED_OFFSET}
        task_held = _problems(spec.name, held_config)
        questions = {p.prompt for p in task_held}
        pool = [p for p in _problems(spec.name, config) if p.prompt not in questions]
        if not pool and spec.weight > 0:
            raise UserError(
                f"data.tasks {spec.name!r}: every one of its {config.get('size')} training problems is also held out; "
                "raise its size, or widen its config (the generator has too few distinct problems)."
            )
        random.Random(task_seed).shuffle(pool)
        held += task_held
        pools.append(pool)
    total = num_train or sum(len(p) for p, s in zip(pools, specs, strict=True) if s.weight > 0)
    rng, cursors, weights = random.Random(seed), [0] * len(specs), [s.weight if pools[i] else 0.0 for i, s in enumerate(specs)]
    train = []
    for t in rng.choices(range(len(specs)), weights=weights, k=total):
        train.append(pools[t][cursors[t] % len(pools[t])])
        cursors[t] += 1
    return train, held
