"""What every algorithm declares, and where the rest of the code reads the declarations: an
`AlgorithmSpec` (its config class, its check, what it needs) is written in the algorithm's own
module, `rltrain/algos/<name>.py`, and listed in rltrain/algos/registry.py. Validation, the `algo`
group's schemas, the engines' roles and the trainer read them here, through `ALGORITHMS`, which
loads that list on first use: the algorithms sit above this layer (docs/architecture.md, "Layers").
docs/adding-an-algorithm.md walks adding one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from omegaconf import MISSING

# rltrain/data: sft_data, preference_data (pairs), unpaired_data (labelled completions), prompt_data
DataKind = Literal["completions", "preferences", "unpaired", "prompts"]
ReferenceNeed = Literal["never", "always", "when_beta"]  # when_beta: only with algo.beta > 0
OutputHead = Literal["lm", "scalar"]  # scalar: the trained model ends in a one-output head (a reward model)

# The module listing every algorithm's spec, imported by name on the first read of `ALGORITHMS`.
DECLARATIONS = "rltrain.algos.registry"


@dataclass
class AlgoConfig:
    """The base of every `algo` option's schema (each `conf/algo/<name>.yaml` extends `algo/<name>_schema`)."""

    name: str = MISSING


class _WithBeta(Protocol):
    beta: float


def _no_checks(algo: AlgoConfig) -> None:
    """An algorithm whose keys the schema's types already bound."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm is and needs. `impl`: the class the trainer builds with the run's context;
    `check`: the value checks its schema cannot express (run by rltrain.preflight.validate);
    `generates`: it samples from the policy with a rollout engine each step (so `rollout`,
    `placement.max_staleness`, `env` apply); `rewards`: its samples are scored (`reward.fns`,
    `reward_model`, environments); `reference`: when a frozen reference is built; `critic`: PPO's
    value model; `teacher`: a model scoring the policy's samples; `head`: the trained model's output,
    the LM head or a scalar head (a reward model, saved as a Hugging Face sequence classifier)."""

    name: str
    config: type[AlgoConfig]
    impl: Callable[[Any], Any]
    summary: str  # one line, for --help and the docs
    data: DataKind
    generates: bool = False
    rewards: bool = False
    reference: ReferenceNeed = "never"
    critic: bool = False
    teacher: bool = False
    head: OutputHead = "lm"
    check: Callable[[Any], None] = _no_checks

    def builds_reference(self, algo: AlgoConfig) -> bool:
        """Whether a run of this algorithm with settings `algo` builds a reference model."""
        return self.reference == "always" or (self.reference == "when_beta" and cast(_WithBeta, algo).beta != 0)


class _Declared(Mapping[str, AlgorithmSpec]):
    """{name: spec} of every algorithm, read from `DECLARATIONS` when first asked."""

    def __init__(self, module: str) -> None:
        self._module = module
        self._specs: dict[str, AlgorithmSpec] | None = None

    def _loaded(self) -> dict[str, AlgorithmSpec]:
        if self._specs is None:
            specs: tuple[AlgorithmSpec, ...] = importlib.import_module(self._module).SPECS
            self._specs = {spec.name: spec for spec in specs}
        return self._specs

    def __getitem__(self, name: str) -> AlgorithmSpec:
        return self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())


class _Configs(Mapping[str, type]):
    """{name: config class}: the `algo` group's schemas, read from `ALGORITHMS` when first asked."""

    def __getitem__(self, name: str) -> type:
        return ALGORITHMS[name].config

    def __iter__(self) -> Iterator[str]:
        return iter(ALGORITHMS)

    def __len__(self) -> int:
        return len(ALGORITHMS)


ALGORITHMS: Mapping[str, AlgorithmSpec] = _Declared(DECLARATIONS)
SPECS = ALGORITHMS.values()
ALGORITHM_CONFIGS: Mapping[str, type] = _Configs()


def spec_of(name: str) -> AlgorithmSpec:
    return ALGORITHMS[name]


def names_where(predicate: Callable[[AlgorithmSpec], bool]) -> list[str]:
    """The algorithms whose spec satisfies `predicate`, for messages ("GRPO and PPO do")."""
    return [spec.name for spec in SPECS if predicate(spec)]
