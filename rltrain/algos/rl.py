"""One RL step, collect then update, for every RL algorithm (GRPO, PPO).

The data, the rollout engine, the trainer's scoring and the mini-batch loop live here once; what an
algorithm needs (a reference, a critic) comes from its declaration (rltrain.config.algorithms), and
it implements `advantages` (and `needs_old_logps_first` where its advantages read them). Generating ahead (`placement.max_staleness`), the batch comes from the
schedule of rltrain/algos/async_rollouts.py instead. The step in order: docs/internals/algos.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from rltrain.algos.async_rollouts import AsyncRollouts
from rltrain.algos.experience import Experience, ExperienceCollector
from rltrain.algos.inflight_rollouts import InFlightRollouts, StreamingEngine, evaluated_versions
from rltrain.algos.rl_evaluation import evaluate
from rltrain.algos.rl_update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
from rltrain.backends import build_engine, build_reference
from rltrain.backends.base import LogProbScorer
from rltrain.config.algorithms import spec_of
from rltrain.config.run_context import RunContext
from rltrain.data.ragged import Ragged
from rltrain.data.sharding import sum_over_replicas
from rltrain.envs.build import build_episode_runner
from rltrain.rewards.scoring import RewardScorer, build_reward_fns
from rltrain.rollout import build_rollout
from rltrain.rollout.ahead import RolloutWorker
from rltrain.rollout.share import leads
from rltrain.run.metrics_log import append_batch_record
from rltrain.run.samples import Sample
from rltrain.runtime.distributed import global_max
from rltrain.runtime.precision import resolve_precision
from rltrain.safety.parity import check_parity, parity_limit
from rltrain.sync.timeshare import TimeSharing
from rltrain.sync.weight_sync import WeightSync


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
        try:
            self._build(ctx)
        except BaseException:
            self._built.close()
            raise

    def _build(self, ctx: RunContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        a = self.algo_cfg = cfg.algo
        self.spec = spec_of(a.name)
        # The LR schedule spans every optimizer step the run will take.
        optimizer_steps = cfg.trainer.max_steps * a.mini_batches * a.num_iterations
        self.policy = build_engine(ctx, "policy", optimizer_steps)
        self.reference: LogProbScorer | None = None
        reference_engine = None  # the reference's own engine (none for a LoRA policy's base)
        if self.spec.builds_reference(a):
            self.reference, reference_engine = build_reference(ctx, self.policy, cfg.trainer.max_steps)
        elif self.spec.teacher:  # scored where a reference would be: its log-probabilities arrive as `ref_logps`
            self.reference = reference_engine = build_engine(ctx, "teacher", cfg.trainer.max_steps)
        self.rollout = build_rollout(ctx)
        self._built.callback(self.rollout.close)
        self.critic = build_engine(ctx, "critic", optimizer_steps) if self.spec.critic else None
        engines = [e for e in (self.policy, reference_engine, self.critic) if e is not None]
        # env=python and env=agent: the environment (agent) gives the reward; reward.fns are not called.
        reward_fns = build_reward_fns(cfg, ctx.dist.device) if cfg.env.name not in ("python", "agent") else []
        frozen = [rf.device_model for rf in reward_fns if rf.device_model is not None]
        k = cfg.placement.max_staleness
        in_flight = cfg.placement.weight_update == "in_flight"  # the engine's own loop takes versions as they come
        # k >= 1: the engine runs beside the trainer, driven by its own thread (docs/async.md).
        worker = RolloutWorker() if k >= 1 and not in_flight else None
        self.weights = WeightSync(self.rollout, deferred=cfg.placement.time_sharing, worker=worker)
        self.timeshare = TimeSharing(engines, self.rollout, ctx.dist.device, cfg.placement.time_sharing, self.weights, frozen)
        plays = leads(self.policy.replica_group())  # a replica's peers receive scores and episodes
        scorer = RewardScorer(reward_fns, cfg.reward, cfg.safety.collective_timeout_s, start_workers=plays)
        self._built.callback(scorer.close)
        episodes = build_episode_runner(cfg, ctx.tokenizer, start_workers=plays)
        if episodes is not None:
            self._built.callback(episodes.close)
        if worker is not None:  # closed first: a call it runs may use the episodes' workers
            self._built.callback(worker.close)
        self.collector = ExperienceCollector(ctx, self.rollout, self.timeshare, self.policy, scorer, episodes)
        self.ahead: AsyncRollouts | None = None
        if worker is not None:  # each engine call is bounded by rollout.timeout_s; a wait spans k + 2 of them
            self.ahead = AsyncRollouts(
                self.collector, self.rollout, worker, k, cfg.trainer.max_steps, cfg.rollout.timeout_s * (k + 2), ctx.dist.rank
            )
        self.inflight: InFlightRollouts | None = None
        if in_flight:
            self.inflight = InFlightRollouts(
                self.collector, cast(StreamingEngine, self.rollout), cfg.placement, cfg.trainer.max_steps,
                evaluated_versions(cfg.trainer.eval_every, cfg.trainer.max_steps) if self.collector.eval_prompts else [],
            )
        parity = ParityProbe()
        update = MiniBatchUpdate(
            self.collector.layout, a.mini_batches, a.num_iterations, cfg.trainer.micro_batch_size, cfg.trainer.max_tokens_per_micro_batch
        )
        # On-policy with one optimizer step per batch: old log-probabilities, entropy and the
        # parity check come from the training pass itself (same weights, before the update), which
        # saves a forward over the whole batch every step.
        fused = a.num_iterations == 1 and a.mini_batches == 1 and not self.needs_old_logps_first()
        loss_fn = make_policy_loss(a, parity, kl_in_loss=self.kl_in_loss(), max_staleness=k)
        self.learner = Learner(self.policy, update, loss_fn, parity, fused, self.reference, self.critic)
        precision = resolve_precision(cfg.trainer.precision, ctx.dist.device).name
        self.parity_limit = parity_limit(cfg.safety.max_logprob_diff, precision)

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
