"""Reward functions, `fn(prompts, completions, **columns) -> list[float]`: built-in ones for the
built-in tasks (`builtin`), user functions by dotted path (`reward.fns`, weighted by
`reward.weights`) and a reward model (`model_reward`), each bounded by `reward.timeout_s`.
docs/rewards-and-roles.md explains the signature, the weighting and the time bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from math import (
    isfinite,  # by name: the submodule rltrain.rewards.math, once imported, is this package's `math`
)
from typing import TYPE_CHECKING, Any

from rltrain.models.hub import local_model_dir
from rltrain.runtime.errors import UserError
from rltrain.runtime.user_code import load_callable

if TYPE_CHECKING:
    import torch

    from rltrain.rewards.model_reward import SequenceClassifierReward
    from rltrain.sync.timeshare import HostOffloadable

BUILTIN_FOR_TASK = {"addition": "rltrain.rewards.builtin:addition_reward"}


@dataclass
class RewardFn:
    name: str
    path: str
    fn: Callable
    weight: float
    timeout_s: float | None = None  # None: no limit
    device_model: HostOffloadable | None = None  # a model it holds on the training device (time sharing moves it)


def build_reward_fns(cfg, device: torch.device) -> list[RewardFn]:
    """The run's reward functions: `reward.fns` (the built-in task's reward when empty and the data
    is built in), plus the reward model named `model` when `reward_model=hf`, loaded on `device`."""
    reward_cfg, rm = cfg.reward, cfg.reward_model
    paths = list(reward_cfg.fns)
    if not paths and cfg.data.path is None:
        paths = [BUILTIN_FOR_TASK[cfg.data.task]]
    if not paths and rm.path is None:
        raise UserError(
            "GRPO on a user dataset needs reward functions: set reward.fns=[package.module:function] "
            "(signature: fn(prompts, completions, **columns) -> list[float]), or a reward model "
            "(reward_model=hf reward_model.path=DIR)."
        )
    weights = list(reward_cfg.weights) or [1.0] * len(paths)
    if len(weights) != len(paths):
        raise UserError(f"reward.weights has {len(weights)} entries but reward.fns has {len(paths)}; give one weight per function.")
    timeout = float(reward_cfg.timeout_s) if reward_cfg.timeout_s else None
    fns = [RewardFn(p.split(":")[-1].split(".")[-1], p, load_callable("reward function", p), float(w), timeout) for p, w in zip(paths, weights)]
    if rm.path is not None:
        model = load_reward_model(cfg, device)
        fns.append(RewardFn("model", f"reward_model.path={rm.path}", model, float(rm.weight), timeout, device_model=model))
    return fns


def load_reward_model(cfg, device: torch.device) -> SequenceClassifierReward:
    """The reward model of `reward_model.path` in the run's compute dtype (rewards/model_reward.py)."""
    from rltrain.rewards.model_reward import SequenceClassifierReward
    from rltrain.runtime.precision import resolve_precision

    rm = cfg.reward_model
    dtype = resolve_precision(cfg.trainer.precision, device).compute_dtype
    directory = local_model_dir("reward_model.path", rm.path, rm.revision)
    return SequenceClassifierReward(directory, device, dtype, rm.batch_size, rm.max_length)


def call_bounded(rf: RewardFn, **kwargs) -> object:
    """`rf.fn(**kwargs)`, raising UserError if it has not returned within `rf.timeout_s`."""
    if not rf.timeout_s:
        return rf.fn(**kwargs)
    result: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            result["value"] = rf.fn(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"rltrain-reward-{rf.name}", daemon=True).start()
    if not done.wait(rf.timeout_s):
        raise UserError(
            f"reward function {rf.path!r} did not return within reward.timeout_s={rf.timeout_s:g} s "
            f"(scoring {len(kwargs.get('completions', []))} completions). Make it faster or raise the "
            "limit (reward.timeout_s=0 turns it off)."
        )
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]


def score(fns: list[RewardFn], prompts: list[str], completions: list[str], columns: dict[str, list]) -> dict[str, list[float]]:
    """Each function's rewards, checked: one finite float per completion, else a UserError naming it."""
    out: dict[str, list[float]] = {}
    if not completions:
        return {rf.name: [] for rf in fns}  # an empty slice: nothing to score, nothing is called
    for rf in fns:
        try:
            values: Any = call_bounded(rf, prompts=prompts, completions=completions, **columns)  # checked below
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"reward function {rf.path!r} raised {type(exc).__name__}: {exc}") from exc
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as exc:
            raise UserError(f"reward function {rf.path!r} must return a list of floats; got {values!r:.200}") from exc
        if len(values) != len(completions):
            raise UserError(
                f"reward function {rf.path!r} returned {len(values)} rewards for {len(completions)} completions; "
                "it must return exactly one per completion."
            )
        if not all(isfinite(v) for v in values):
            raise UserError(f"reward function {rf.path!r} returned a non-finite reward.")
        out[rf.name] = values
    return out
