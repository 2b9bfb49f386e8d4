"""`env=python`, the trainer's side: a user environment class answers each reply with `step`.

The environment objects live in call workers (rltrain/envs/hosted.py holds them); every call
carries the episode's actions so far, so a worker that lost an episode (killed on a timeout) rebuilds
it by replay. A failed call ends its episode, which scores `reward.on_failure`; more than
`reward.max_failure_frac` of a phase's episodes failing stops the run with a UserError naming the
class (docs/environments.md, "Timeouts and rebuilt episodes"). Observations may hold images
(docs/vision.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltrain.config.group_options import EnvConfig
from rltrain.config.schema import RewardConfig
from rltrain.envs.episodes import Episode, check_failed_episodes
from rltrain.envs.observations import ObservationRenderer
from rltrain.envs.wire import from_wire
from rltrain.runtime.call_pool import Call, CallPool, CallResult
from rltrain.runtime.errors import UserError

ADVANCE = "rltrain.envs.hosted:advance"


@dataclass(frozen=True)
class Hosting:
    """What the workers host: `advance` (`module:function`, called with `args` plus the episode's
    key, row and actions), the name errors give it, and the modules a worker imports at its start."""

    advance: str
    args: dict[str, Any]
    name: str
    preload: list[str] = field(default_factory=list)


class HostedEnvironments:
    """`EpisodeSteps` for a user environment class (`env.cls`). `hosting`: another worker-side
    `advance` and its extra arguments, naming what it hosts (env=openenv: rltrain/envs/openenv)."""

    def __init__(
        self, env_cfg: EnvConfig, reward_cfg: RewardConfig, tokenizer, start_workers: bool = True,
        observations: ObservationRenderer | None = None, hosting: Hosting | None = None,
    ) -> None:
        if hosting is None:
            if not env_cfg.cls or ":" not in env_cfg.cls:
                raise UserError(f"env=python needs env.cls=package.module:Class (got {env_cfg.cls!r}).")
            hosting = Hosting(ADVANCE, {"cls": env_cfg.cls}, str(env_cfg.cls), [env_cfg.cls])
        self.cfg, self.reward_cfg, self.tokenizer, self.hosting = env_cfg, reward_cfg, tokenizer, hosting
        self.observations = observations if observations is not None else ObservationRenderer(tokenizer)
        self.timeout_s = float(env_cfg.timeout_s) if env_cfg.timeout_s else None
        self.pool = CallPool(env_cfg.workers, [hosting.advance, *hosting.preload], "environment", env_cfg.max_concurrency)
        if start_workers:  # else on the first call
            self.pool.start()

    def reset(self, episodes: list[Episode], deadline: float) -> None:
        self._advance(episodes, "reset", deadline)

    def step(self, episodes: list[Episode], deadline: float) -> None:
        self._advance(episodes, "step", deadline)

    def check(self, episodes: list[Episode]) -> None:
        check_failed_episodes(episodes, f"the environment {self.hosting.name!r}", self.timeout_s, self.reward_cfg.max_failure_frac,
                              "Fix it, or raise env.timeout_s or reward.max_failure_frac.")

    def close(self) -> None:
        self.pool.close()

    def _advance(self, episodes: list[Episode], what: str, deadline: float) -> None:
        """One reset or step of every episode in `episodes`, in the workers; a failed call ends its episode."""
        if not episodes:
            return
        args = self.hosting.args
        calls = [Call(self.hosting.advance, {**args, "episode": e.key, "row": e.row, "actions": e.actions}) for e in episodes]
        results = self.pool.run(calls, self.timeout_s, deadline)
        for e, result in zip(episodes, results, strict=True):
            self._apply(e, result, what)

    def _apply(self, e: Episode, result: CallResult, what: str) -> None:
        if result.failure is not None or not isinstance(result.value, dict):
            e.done, e.failure = True, "timeout" if result.failure == "timeout" else "error"
            if e.failure == "timeout":
                e.timeouts += 1
            else:
                e.errors += 1
            return
        e.reward += result.value["reward"]
        observation = result.value["observation"]
        if result.value["done"] or (observation is None and what == "step"):
            e.done, e.ended_by_env = True, True
            return
        if observation is not None:
            where = f"{self.hosting.name}.{what}()"
            seen = self.observations.render(from_wire(observation, where), where, e.chat, e.open_reply())
            e.observe(seen, self.cfg.max_total_tokens - len(e.tokens), self.observations.image_token_id)
