"""Scoring a step's completions: every reward function on small chunks in killable workers.

A reward function is user code: it can be slow, hang or raise on one odd completion. So each is
called on chunks of one prompt's group (`reward.chunk_size`) in worker processes
(rltrain.runtime.call_pool): a chunk that raises, returns nonsense or runs past `reward.timeout_s`
scores `reward.on_failure` and is counted (`reward/errors`, `reward/timeouts`), and the run goes on.
Only when more than `reward.max_failure_frac` of the samples a rank scores in a step fail for one
function does that rank stop with a UserError naming it; and every rank's scoring ends by half the
collective timeout, so a peer never waits into it. The reward model is ours and on the training
device: it runs in the trainer's process. docs/rewards-and-roles.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from math import isfinite
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from rltrain.config.algorithms import spec_of
from rltrain.config.schema import Config, RewardConfig
from rltrain.data.column_wire import to_wire
from rltrain.rewards.code import COUNTED as CODE_COUNTED
from rltrain.rewards.code import METRICS as CODE_METRICS
from rltrain.rewards.judge.judge import METRICS as JUDGE_METRICS
from rltrain.rewards.judge.judge import LLMJudge
from rltrain.rewards.sandbox.settings import check as check_sandbox
from rltrain.rewards.sandbox.settings import worker_env
from rltrain.rewards.thinking import DEFAULT_THINKING_END, THINKING_END_ENV
from rltrain.rewards.worker_call import WORKER_CALL
from rltrain.runtime.call_pool import Call, CallPool, CallResult
from rltrain.runtime.errors import UserError
from rltrain.runtime.user_code import load_callable

if TYPE_CHECKING:
    import torch

    from rltrain.rewards.model_reward import SequenceClassifierReward
    from rltrain.rewards.vision_model_reward import VisionSequenceReward
    from rltrain.sync.timeshare import HostOffloadable

# Functions whose worker-side twin returns {"rewards": [...], "metrics": {name: [...]}}: the twin's
# path, the metric names (logged as reward/<name>) and which of them are counts (summed, not averaged).
REPORTING = {"rltrain.rewards.code:tests_pass": ("rltrain.rewards.code:tests_pass_reported", CODE_METRICS, CODE_COUNTED)}

BUILTIN_FOR_TASK = {
    "addition": "rltrain.rewards.builtin:addition_reward",
    "multiplication": "rltrain.rewards.builtin:exact_match",  # the tool task: the product, exactly
    "code": "rltrain.rewards.code:tests_pass",  # the code task: its hidden cases, in the sandbox
    "colours": "rltrain.rewards.builtin:exact_match",  # the visual task: the colour's name, exactly
    "reasoning_gym": "rltrain.rewards.reasoning_gym:score_answer",  # each row's dataset's own verifier
}


@dataclass
class RewardFn:
    name: str
    path: str
    fn: Callable
    weight: float
    device_model: HostOffloadable | None = None  # a model it holds on the training device (time sharing moves it)
    # Ours, called in the trainer's process (the reward model, the judge); returns {"rewards", "metrics"}
    # when `reports` names its metrics, and `close` releases what it holds (the judge's server).
    in_process: bool = False
    reports: tuple[str, ...] = ()
    close: Callable[[], None] | None = None
    reads_images: bool = False  # called with each row's prompt images (`prompt_images`, a vision reward model)

    @property
    def call_path(self) -> str:
        """What its worker calls: the function, or its twin that also reports metrics."""
        return REPORTING[self.path][0] if self.path in REPORTING else self.path

    @property
    def metrics(self) -> tuple[str, ...]:
        return REPORTING[self.path][1] if self.path in REPORTING else self.reports


@dataclass
class Failures:
    """Samples (per reward function) whose score is `reward.on_failure` because their chunk failed."""

    timeouts: int = 0
    errors: int = 0


class Scored(NamedTuple):
    """A batch's rewards: per function (unweighted), the failures, the weighted total per sample."""

    per_fn: dict[str, list[float]]
    failures: Failures
    scores_B: torch.Tensor  # float64, host


def build_reward_fns(
    cfg: Config, device: torch.device, run_dir: Path | None = None, rank: int = 0, scores: bool = True
) -> list[RewardFn]:
    """The run's reward functions: `reward.fns` (the built-in task's reward when empty and the data
    is built in), plus the reward model named `model` when `reward_model=hf`, loaded on `device`, or
    the LLM judge named `judge` when `reward_model=judge` (its server's log in `run_dir`). A rank
    that never scores (`scores=False`: a peer in a model-parallel replica, which receives its lead's
    scores) starts no judge server and loads no reward model: their entries only name the series."""
    reward_cfg, rm = cfg.reward, cfg.reward_model
    paths = reward_paths(cfg)
    if not paths and rm.name == "none":
        raise UserError(
            "GRPO on a user dataset needs reward functions: set reward.fns=[package.module:function] "
            "(signature: fn(prompts, completions, **columns) -> list[float]), or a reward model "
            "(reward_model=hf reward_model.path=DIR)."
        )
    weights = list(reward_cfg.weights) or [1.0] * len(paths)
    if len(weights) != len(paths):
        raise UserError(f"reward.weights has {len(weights)} entries but reward.fns has {len(paths)}; give one weight per function.")
    fns = [RewardFn(p.split(":")[-1].split(".")[-1], p, load_callable("reward function", p), float(w)) for p, w in zip(paths, weights)]
    check_reward_needs(cfg)
    if rm.name == "judge":
        source = f"reward_model.path={rm.path}" if rm.path is not None else f"reward_model.url={rm.url}"
        if scores:
            judge = build_judge(cfg, device, Path(run_dir or "."), rank)
            fns.append(RewardFn("judge", f"judge {source}", judge, float(rm.weight), in_process=True,
                                reports=JUDGE_METRICS, close=judge.close))
        else:
            fns.append(RewardFn("judge", f"judge {source}", _scored_by_the_replica_lead, float(rm.weight),
                                in_process=True, reports=JUDGE_METRICS))
    elif rm.path is not None and scores:
        model = load_reward_model(cfg, device)
        fns.append(RewardFn("model", f"reward_model.path={rm.path}", model, float(rm.weight), device_model=model,
                            in_process=True, reads_images=model.reads_images))
    elif rm.path is not None:
        fns.append(RewardFn("model", f"reward_model.path={rm.path}", _scored_by_the_replica_lead, float(rm.weight),
                            in_process=True, reads_images=reads_images(reward_model_dir(cfg))))
    return fns


def _scored_by_the_replica_lead(prompts: list[str], completions: list[str], **columns: Any) -> dict[str, Any]:
    raise RuntimeError("a model-parallel replica's peer called a reward model: only the replica's lead scores")


def build_judge(cfg: Config, device: torch.device, run_dir: Path, rank: int) -> LLMJudge:
    """The LLM judge of `reward_model=judge` (rltrain/rewards/judge)."""
    from rltrain.rewards.judge.build import build_judge as build
    from rltrain.runtime.precision import resolve_precision

    dtype = resolve_precision(cfg.trainer.precision, device).compute_dtype_name
    return build(cfg, dtype, device.type == "cuda", run_dir, rank)


def reward_paths(cfg: Config) -> list[str]:
    """The run's reward functions' paths: `reward.fns`, or the built-in task's reward when that is
    empty and the data is built in."""
    paths = list(cfg.reward.fns)
    return paths if paths or cfg.data.path is not None else [BUILTIN_FOR_TASK[cfg.data.task]]


def check_reward_needs(cfg: Config) -> None:
    """What the chosen functions need from this machine, checked at start: the code reward's
    sandbox (bwrap installed, its settings sane). Only for an algorithm that scores samples."""
    if spec_of(cfg.algo.name).rewards and any(path in REPORTING for path in reward_paths(cfg)):
        check_sandbox(cfg.reward.sandbox)


def reward_model_dir(cfg: Config) -> Path:
    """The directory `reward_model.path` names (a Hub id's snapshot)."""
    from rltrain.config.hub import local_model_dir

    return local_model_dir("reward_model.path", cfg.reward_model.path, cfg.reward_model.revision)


def reads_images(directory: Path) -> bool:
    """Whether the reward model in `directory` is a vision-language one (it reads each row's images)."""
    import json

    from rltrain.backends.sequence_classifier import is_vision_reward_config

    return is_vision_reward_config(json.loads((directory / "config.json").read_text()))


def load_reward_model(cfg: Config, device: torch.device) -> SequenceClassifierReward | VisionSequenceReward:
    """The reward model of `reward_model.path` in the run's compute dtype: a sequence classifier
    (rewards/model_reward.py), or a vision-language model's with its head's file, which reads
    each row's images (rewards/vision_model_reward.py)."""
    from rltrain.rewards.model_reward import SequenceClassifierReward
    from rltrain.rewards.vision_model_reward import VisionSequenceReward
    from rltrain.runtime.precision import resolve_precision

    rm = cfg.reward_model
    dtype = resolve_precision(cfg.trainer.precision, device).compute_dtype
    directory = reward_model_dir(cfg)
    if reads_images(directory):
        return VisionSequenceReward(directory, device, dtype, rm.batch_size, rm.max_length)
    return SequenceClassifierReward(directory, device, dtype, rm.batch_size, rm.max_length)


def chunk_bounds(groups: list[int], chunk_size: int, spans_groups: bool) -> list[tuple[int, int]]:
    """[start, end) ranges over completions listed prompt by prompt (`groups[i]`: completion i's
    prompt): one prompt's group each (`chunk_size` 0), or at most `chunk_size` completions of one
    group, or of consecutive groups when `spans_groups`."""
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(groups) + 1):
        ends_group = i == len(groups) or groups[i] != groups[i - 1]
        full = chunk_size > 0 and i - start >= chunk_size
        if full or (ends_group and not spans_groups) or i == len(groups):
            bounds.append((start, i))
            start = i
    return bounds


def checked_values(result: CallResult, n: int, timeout_s: float | None) -> tuple[list[float] | None, str, str]:
    """(values, failure kind, what went wrong): values None when the call failed or returned
    something other than `n` finite floats."""
    if result.failure == "timeout":
        return None, "timeout", f"did not return within reward.timeout_s={timeout_s:g} s" if timeout_s else "was stopped"
    if result.failure is not None:
        return None, "error", result.message if result.failure == "died" else f"raised {result.message}"
    try:
        values = [float(v) for v in result.value]
    except (TypeError, ValueError):
        return None, "error", f"must return a list of floats; got {result.value!r:.200}"
    if len(values) != n:
        return None, "error", f"returned {len(values)} rewards for {n} completions; it must return exactly one per completion"
    if not all(isfinite(v) for v in values):
        return None, "error", "returned a non-finite reward"
    return values, "", ""


def split_report(result: CallResult, reporting: bool) -> tuple[CallResult, dict[str, Any]]:
    """A reporting twin's {"rewards", "metrics"} as the rewards' result and the metrics."""
    if not reporting or result.failure is not None or not isinstance(result.value, dict):
        return result, {}
    return CallResult(value=result.value.get("rewards")), result.value.get("metrics") or {}


class RewardScorer:
    """The run's reward functions and the worker pool that runs the user ones."""

    def __init__(
        self, fns: list[RewardFn], reward_cfg: RewardConfig, collective_timeout_s: float, start_workers: bool = True,
        thinking_end: str = DEFAULT_THINKING_END,
    ) -> None:
        """`thinking_end`: the marker the answer rewards read after (`thinking_end_marker`)."""
        self.fns, self.cfg, self.thinking_end = fns, reward_cfg, thinking_end
        self.timeout_s = float(reward_cfg.timeout_s) if reward_cfg.timeout_s else None
        self.budget_s = collective_timeout_s / 2  # a rank's scoring never keeps a peer into the collective timeout
        pooled = [rf.call_path for rf in fns if not rf.in_process]
        env = {THINKING_END_ENV: thinking_end, **(worker_env(reward_cfg) if any(rf.metrics for rf in fns) else {})}
        # The workers import every function as they start, and call each through WORKER_CALL, which
        # decodes the images and bytes of its columns (JSON carries neither).
        self.pool = CallPool(reward_cfg.workers, [WORKER_CALL, *pooled], "reward function", env=env) if pooled else None
        if self.pool is not None and start_workers:  # else they start on the first call (a replica's peers never score)
            self.pool.start()  # the workers import while the engines are built
        self.counted = {m for rf in fns if rf.path in REPORTING for m in REPORTING[rf.path][2]} | {m for rf in fns for m in rf.reports}

    def series_names(self) -> list[str]:
        """The keys of `score`'s first result: each function's, then the metrics they report."""
        return list(dict.fromkeys([rf.name for rf in self.fns] + [m for rf in self.fns for m in rf.metrics]))

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], groups: list[int],
        images: list[list] | None = None,
    ) -> tuple[dict[str, list[float]], Failures]:
        """Each function's rewards (one float per completion), each reported metric's values, and
        the samples that failed. `columns`: every column of each completion's row, a row's images
        as PIL images (rltrain.data.vision_rows.columns_with_images), which cross to the workers
        as PNG (rltrain.data.column_wire). `images`: each completion's prompt images (PIL, as the
        rollout engine saw them), for a reward model that reads them as `prompt_images`."""
        failures = Failures()
        if not completions:
            return {name: [] for name in self.series_names()}, failures  # an empty slice: nothing is called
        deadline = time.monotonic() + self.budget_s
        bounds = chunk_bounds(groups, self.cfg.chunk_size, self.cfg.chunk_spans_groups)
        pooled = [rf for rf in self.fns if not rf.in_process]
        wired = to_wire(columns) if pooled else {}  # each of the step's images encoded once
        calls = [
            Call(WORKER_CALL, {"fn": rf.call_path, "kwargs": {
                "prompts": prompts[s:e], "completions": completions[s:e], **{k: v[s:e] for k, v in wired.items()}
            }})
            for rf in pooled
            for s, e in bounds
        ]
        results = self.pool.run(calls, self.timeout_s, deadline) if self.pool is not None else []
        out: dict[str, list[float]] = {}
        for i, rf in enumerate(pooled):
            self._collect(rf, bounds, results[i * len(bounds) : (i + 1) * len(bounds)], len(completions), failures, out)
        for rf in self.fns:
            if rf.in_process:
                out.update(in_process(rf, prompts, completions, columns, images))
        return {name: out[name] for name in self.series_names()}, failures

    def _collect(
        self, rf: RewardFn, bounds: list[tuple[int, int]], results: list[CallResult], n: int, failures: Failures,
        out: dict[str, list[float]],
    ) -> None:
        """`rf`'s chunks into `out` (its rewards and metrics); a failed chunk scores
        `reward.on_failure` (metrics 0) and is counted; too many failures stop the rank."""
        values: list[float] = []
        metrics: dict[str, list[float]] = {m: [] for m in rf.metrics}
        failed, first_problem = 0, ""
        for (s, e), raw in zip(bounds, results, strict=True):
            result, reported = split_report(raw, bool(rf.metrics))
            chunk, kind, problem = checked_values(result, e - s, self.timeout_s)
            if chunk is None:
                chunk = [float(self.cfg.on_failure)] * (e - s)
                failed += e - s
                first_problem = first_problem or problem
                if kind == "timeout":
                    failures.timeouts += e - s
                else:
                    failures.errors += e - s
            values += chunk
            for m in rf.metrics:
                got = reported.get(m) if not kind else None
                metrics[m] += [float(v) for v in got] if isinstance(got, list) and len(got) == e - s else [0.0] * (e - s)
        if failed > self.cfg.max_failure_frac * n:
            raise UserError(
                f"reward function {rf.path!r} {first_problem} (on {failed} of the {n} samples this "
                f"rank scored, more than reward.max_failure_frac={self.cfg.max_failure_frac:g}). Fix the function, "
                "or raise reward.timeout_s or reward.max_failure_frac."
            )
        out[rf.name] = values
        out.update(metrics)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for rf in self.fns:
            if rf.close is not None:
                rf.close()


def in_process(
    rf: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, list], images: list[list] | None = None
) -> dict[str, list[float]]:
    """The reward model or the judge (our code): called directly, its output checked; its rewards
    under its name and the metrics it reports. One that reads images gets each completion's prompt
    images as `prompt_images`."""
    seen = {"prompt_images": images} if rf.reads_images else {}
    values: Any = rf.fn(prompts=prompts, completions=completions, **{**columns, **seen})
    result, reported = split_report(CallResult(value=values), bool(rf.reports))
    checked, _, problem = checked_values(result, len(completions), None)
    if checked is None:
        raise UserError(f"reward function {rf.path!r} {problem}.")
    return {rf.name: checked, **{m: [float(v) for v in reported.get(m, [0.0] * len(completions))] for m in rf.reports}}
