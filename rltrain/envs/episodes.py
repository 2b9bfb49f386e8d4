"""Multi-turn episodes on the trainer's side: the model's turns from the rollout engine, the
environment's steps from worker processes, and one token sequence per episode.

An episode starts from its prompt's token ids (plus `reset`'s observation, if any). Each turn the
engine samples the model's reply from the episode's ids so far (all live episodes in one engine
call); the reply's text goes to the environment's `step`; the observation it returns is tokenized
and appended (rltrain/envs/observations.py). The episode ends when the environment says `done` or
returns no observation, after `env.max_turns` replies, or when `env.max_total_tokens` is spent. The
result is a `Completion` per episode whose ids are exactly what the engine saw and sampled, with
`sampled` marking the model's tokens: only those get policy gradient (docs/environments.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rltrain.data.prompt_data import PromptRow
from rltrain.envs.observations import observation_ids
from rltrain.rewards.scoring import Failures
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.runtime.call_pool import Call, CallPool, CallResult
from rltrain.runtime.errors import UserError

ADVANCE = "rltrain.envs.hosted:advance"
TURN_SEED_STRIDE = 100_003  # each turn samples with its own seed


@dataclass
class Episode:
    prompt_index: int
    key: str  # "phase:index", unique within the phase (rltrain/envs/hosted.py)
    row: dict[str, Any]
    context: list[int]  # the prompt's ids, then `tokens`
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    logprobs: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False  # no more turns
    ended_by_env: bool = False  # the environment said done (else max_turns or the token budget)
    failure: str | None = None  # "timeout" or "error": the episode scores reward.on_failure

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.tokens += ids
        self.context += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.sampled += [logprobs is not None] * len(ids)

    def completion(self) -> Completion:
        return Completion(self.prompt_index, self.tokens, self.logprobs, self.ended_by_env, list(self.sampled))


@dataclass
class EpisodeResults:
    completions: list[Completion]  # one per episode, prompt-major
    returns: list[float]  # the sum of each episode's step rewards (reward.on_failure for a failed one)
    failures: Failures  # episodes that failed (a reset or step raised, returned nonsense or timed out)
    turns: float  # the model's turns, summed over episodes


class EpisodeRunner:
    """Runs the episodes of a step for one rank: `generate(prompts, sampling)` is the collector's
    engine call (every rank of a replica calls it together), `pool` hosts the environments."""

    def __init__(self, env_cfg, reward_cfg, tokenizer, max_new_tokens: int, collective_timeout_s: float) -> None:
        if not env_cfg.cls or ":" not in env_cfg.cls:
            raise UserError(f"env=python needs env.cls=package.module:Class (got {env_cfg.cls!r}).")
        self.cfg, self.reward_cfg, self.tokenizer = env_cfg, reward_cfg, tokenizer
        self.turn_tokens = env_cfg.max_tokens_per_turn or max_new_tokens
        self.timeout_s = float(env_cfg.timeout_s) if env_cfg.timeout_s else None
        self.budget_s = collective_timeout_s / 2  # a step's environment calls, all turns together
        self.pool = CallPool(env_cfg.workers, [ADVANCE, env_cfg.cls], "environment")
        self.pool.start()

    def run(
        self, rows: list[PromptRow], copies: int, sampling: SamplingSettings, phase: str,
        generate: Callable[[list[list[int]], SamplingSettings], list[Completion]],
    ) -> EpisodeResults:
        """`copies` episodes per row (GRPO's group), prompt-major. `phase` names the step (e.g.
        "train-12"): the workers drop the episodes of an earlier phase."""
        episodes = [
            Episode(i, f"{phase}:{i * copies + k}", {"prompt": row.text, **row.columns}, list(row.ids))
            for i, row in enumerate(rows)
            for k in range(copies)
        ]
        failures = Failures()
        # One deadline for every call of the phase: however many turns hang, a peer never waits
        # into the collective timeout.
        deadline = time.monotonic() + self.budget_s
        self._advance(episodes, failures, "reset", deadline)
        turns = 0
        for turn in range(self.cfg.max_turns):
            live = [e for e in episodes if not e.done and len(e.tokens) < self.cfg.max_total_tokens]
            if not live:
                break
            most_room = max(self.cfg.max_total_tokens - len(e.tokens) for e in live)
            turn_sampling = replace(
                sampling, n=1, max_new_tokens=min(self.turn_tokens, most_room), seed=sampling.seed + TURN_SEED_STRIDE * turn
            )
            replies = generate([e.context for e in live], turn_sampling)
            for e, reply in zip(live, replies, strict=True):
                room = self.cfg.max_total_tokens - len(e.tokens)
                e.append(reply.token_ids[:room], reply.logprobs[:room])  # a prefix of what was sampled
                e.actions.append(self._text(reply.token_ids[:room], sampling.stop_token_ids))
            turns += len(live)
            self._advance(live, failures, "step", deadline)
        for e in episodes:
            if e.failure is not None:
                e.reward = float(self.reward_cfg.on_failure)
            if not e.tokens:  # its reset failed: one stop token, not sampled (no gradient), keeps the batch's layout
                e.append(sampling.stop_token_ids[:1], None)
        failed = failures.timeouts + failures.errors
        if failed > self.reward_cfg.max_failure_frac * len(episodes):
            raise UserError(
                f"the environment {self.cfg.cls!r} failed on {failed} of this rank's {len(episodes)} episodes "
                f"({failures.timeouts} timed out after env.timeout_s={self.timeout_s}, {failures.errors} raised), more than "
                f"reward.max_failure_frac={self.reward_cfg.max_failure_frac:g}. Fix it, or raise env.timeout_s or "
                "reward.max_failure_frac."
            )
        return EpisodeResults([e.completion() for e in episodes], [e.reward for e in episodes], failures, float(turns))

    def _text(self, ids: list[int], stop_ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in stop_ids], skip_special_tokens=True)

    def _advance(self, episodes: list[Episode], failures: Failures, what: str, deadline: float) -> None:
        """One reset or step of every episode in `episodes`, in the workers; a failed call ends its episode."""
        if not episodes:
            return
        calls = [Call(ADVANCE, {"cls": self.cfg.cls, "episode": e.key, "row": e.row, "actions": e.actions}) for e in episodes]
        results = self.pool.run(calls, self.timeout_s, deadline)
        for e, result in zip(episodes, results, strict=True):
            self._apply(e, result, failures, what)

    def _apply(self, e: Episode, result: CallResult, failures: Failures, what: str) -> None:
        if result.failure is not None or not isinstance(result.value, dict):
            e.done, e.failure = True, "timeout" if result.failure == "timeout" else "error"
            if e.failure == "timeout":
                failures.timeouts += 1
            else:
                failures.errors += 1
            return
        e.reward += result.value["reward"]
        observation = result.value["observation"]
        if result.value["done"] or (observation is None and what == "step"):
            e.done, e.ended_by_env = True, True
            return
        if observation is not None:
            ids = observation_ids(self.tokenizer, observation, f"{self.cfg.cls}.{what}()")
            e.append(ids[: self.cfg.max_total_tokens - len(e.tokens)], None)

    def close(self) -> None:
        self.pool.close()
