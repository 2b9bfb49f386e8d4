"""One RL step, collect then update, for every RL algorithm (GRPO, PPO, distillation).

What the step runs on is built by rltrain/algos/rl/builder.py from the algorithm's declaration (a
reference, a critic, a teacher); an algorithm implements `advantages` (and `needs_old_logps_first`
where its advantages read them). Generating ahead (`placement.max_staleness`), the batch comes
from the schedule of rltrain/algos/rl/async_rollouts.py instead. The step in order: docs/internals/algos.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.algos.rl.builder import RLBuilder
from rltrain.algos.rl.evaluation import evaluate
from rltrain.algos.rl.experience import Experience
from rltrain.config.run_context import RunContext
from rltrain.data.ragged import Ragged
from rltrain.data.sharding import sum_over_replicas
from rltrain.run.metrics_log import append_batch_record
from rltrain.run.samples import Sample
from rltrain.runtime.distributed import global_max
from rltrain.safety.parity import check_parity


@dataclass
class Advantages:
    """What an algorithm's `advantages` computes for this rank's sequences."""

    adv: torch.Tensor | Ragged  # [B] per sequence or Ragged per completion token
    metrics: dict[str, float] = field(default_factory=dict)
    returns: Ragged | None = None  # the critic's targets (algorithms declared with a critic)


class RLAlgorithm:
    def __init__(self, ctx: RunContext) -> None:
        # What `close` shuts down, registered as each part is built: a failure part-way (a user error
        # in the data, found after the engine is up) shuts the built parts down here, while the
        # process group lives, not in exit-time finalizers after it is gone (docs/failure-behaviour.md).
        self._built = ExitStack()
        self.ctx, self.algo_cfg = ctx, ctx.cfg.algo
        try:
            parts = RLBuilder(ctx, self._built, self.kl_in_loss(), self.needs_old_logps_first()).build()
        except BaseException:
            self._built.close()
            raise
        self.spec, self.policy, self.reference, self.critic = parts.spec, parts.policy, parts.reference, parts.critic
        self.rollout, self.weights, self.timeshare = parts.rollout, parts.weights, parts.timeshare
        self.collector, self.ahead, self.inflight, self.learner = parts.collector, parts.ahead, parts.inflight, parts.learner
        self.parity_limit = parts.parity_limit

    # --- what a subclass decides ---------------------------------------------------------------

    def kl_in_loss(self) -> bool:
        return True

    def needs_old_logps_first(self) -> bool:
        """True when the advantages need the old log-probabilities (e.g. a KL in the reward)."""
        return False

    def advantages(self, exp: Experience) -> Advantages:
        """This rank's advantages (and, with a critic, its targets), with their metrics."""
        raise NotImplementedError

    def update_critic(self, exp: Experience, advantages: Advantages, step: int) -> dict[str, float]:
        """The critic's optimizer steps (algorithms declared with a critic)."""
        return {}

    def updates_policy(self, step: int) -> bool:
        return True

    # --- one step ------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        # 1. Generate. With time sharing this is the engine's turn, and it begins by delivering the
        #    weights published at the end of the last step (the `sync` phase: WeightSync.deliver).
        waits: dict[str, float] = {}
        if self.inflight is not None:
            exp, waits = self.inflight.next_experience(step)
        elif self.ahead is not None:
            exp, waits["time/wait_rollout"] = self.ahead.next_experience(step)
        else:
            exp = self.collector.collect(step)
        if self.ctx.dist.is_main:
            append_batch_record(self.ctx.run_dir, step, exp.global_index, step - 1 - exp.staleness)
        # 2. Learn: score the batch, advantages, the optimizer steps.
        t1 = time.perf_counter()
        with self.timeshare.train():
            self.learner.score(exp)
            advantages = self.advantages(exp)
            stats = self.learner.update_policy(exp, advantages.adv) if self.updates_policy(step) else {}
            stats.update(self.update_critic(exp, advantages, step))
        time_train = time.perf_counter() - t1
        if exp.staleness > 0:
            # Sampled by an older version: the gap is the engine's numerics plus the policy's
            # change since, not parity, so it is reported as such and not checked.
            for stat in ("mean", "max"):
                if f"rollout/logprob_diff_{stat}" in stats:
                    stats[f"rollout/offpolicy_diff_{stat}"] = stats.pop(f"rollout/logprob_diff_{stat}")
        elif "rollout/logprob_diff_max" in stats:
            check_parity(stats["rollout/logprob_diff_max"], self.parity_limit, step)
        # 3. Publish the new weights (an export: a collective on every rank). Without time sharing
        #    they stream into the engine now; with it, into a host copy for the next turn's `sync`;
        #    generating ahead, onto the engine's queue, and the batch this version samples after them.
        self.weights.publish(self.policy.export_weights)
        if self.ahead is not None:
            self.ahead.after_update(step)
            waits.update({
                "rollout/staleness_mean": float(exp.staleness), "rollout/staleness_max": float(exp.staleness),
                "time/wait_train": self.ahead.worker.pop_idle_s(),
            })
        n_global = self.collector.layout.global_size
        dp_size = self.policy.world_size
        return {
            **stats,
            **advantages.metrics,
            **self.collector.reward_metrics(exp),
            "rollout/response_length_mean": float(exp.counts[0] / n_global),
            "rollout/truncated_fraction": float(exp.counts[2] / n_global),
            "rollout/thinking_tokens_mean": float(exp.counts[4] / n_global),  # inside a thinking block
            # in flight, `waits` replaces it (InFlightRollouts: over the engine's busy time since the stream opened)
            "rollout/tokens_per_s": float(exp.counts[0]) / max(global_max(exp.time_rollout), 1e-9),
            "time/rollout": exp.time_rollout,
            "time/train": time_train,
            "time/sync": self.weights.last_sync_s,
            "time/publish": self.weights.last_publish_s,
            "sync/bytes": float(self.weights.last_bytes),
            **version_metrics(exp, self.rollout.metrics()),
            **self.timeshare.pop_metrics(),
            "tokens": float(sum_over_replicas(torch.tensor([float(exp.batch.tokens.num_tokens)], device="cpu"), dp_size)),
            "data/overlong_dropped": float(self.collector.dropped),
            **waits,
        }

    # --- evaluation, state, lifecycle ----------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, float]:
        return evaluate(self.collector, step)

    def samples(self) -> list[Sample]:
        return self.collector.samples()

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.collector.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.stream.load_state_dict(state["stream"])
        # The engine was built from the initial weights: give it the restored ones.
        self.weights.publish(self.policy.export_weights)

    def health_ping(self) -> Callable[[], bool]:
        """The rollout engine's own real ping (`RolloutEngine.ping`) for `/healthz/deep`."""
        return self.rollout.ping

    def close(self) -> None:
        """Shut down, before the trainer's process group goes away, what was built outside the
        trainer, the last built first: the engine's worker thread (generating ahead), the episodes'
        and reward functions' workers, the rollout engine."""
        self._built.close()

    def checkpoint_engines(self) -> dict[str, Any]:
        """What a checkpoint holds besides the trainer state; generating ahead, the batches in flight."""
        parts: dict[str, Any] = {"policy": self.policy}
        if self.critic is not None:
            parts["critic"] = self.critic
        if self.ahead is not None:
            parts["rollouts"] = self.ahead
        if self.inflight is not None:
            parts["rollouts"] = self.inflight
        return parts

    def export_engine(self) -> Any:
        return self.policy


def version_metrics(exp: Experience, engine: dict[str, float]) -> dict[str, float]:
    """The engine's metrics, with `rollout/version_min` and `_max` (where the engine reports them:
    rollout=server) over every rank (a collective: every rank has the same engine). From the
    batch's completions where they carry their version (the batch generated ahead is not the
    engine's latest), else from what the engine observed since the last step (episodes)."""
    if "rollout/version_min" not in engine:
        return engine
    versions = [float(c.version) for c in exp.completions if c.version is not None]
    low, high = (min(versions), max(versions)) if versions else (engine["rollout/version_min"], engine["rollout/version_max"])
    return {**engine, "rollout/version_min": -global_max(-low), "rollout/version_max": global_max(high)}
