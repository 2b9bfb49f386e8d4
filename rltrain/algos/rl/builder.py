"""The RL composition root: everything one RL step is made of (engines, rollout, weight sync, time
sharing, reward scoring, episodes, the experience collector, the schedule that generates ahead, the
learner), built in one fixed order from the run's config and the algorithm's declaration. Each
part that must be shut down is registered on the caller's `ExitStack` as it is built, so a
failure part-way closes what exists (docs/failure-behaviour.md). The step itself: rltrain/algos/rl/algorithm.py.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from rltrain.algos.rl.async_rollouts import AsyncRollouts
from rltrain.algos.rl.experience import ExperienceCollector
from rltrain.algos.rl.inflight_rollouts import InFlightRollouts, StreamingEngine, evaluated_versions
from rltrain.algos.rl.update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
from rltrain.backends import build_engine, build_reference
from rltrain.backends.base import LogProbScorer, TrainEngine
from rltrain.config.algorithms import AlgorithmSpec, spec_of
from rltrain.config.run_context import RunContext
from rltrain.envs.agent.runner import AgentRunner
from rltrain.envs.build import build_episode_runner
from rltrain.envs.episodes import EpisodeRunner
from rltrain.models.vision import load_processor
from rltrain.rewards.scoring import RewardScorer, build_reward_fns
from rltrain.rewards.thinking import thinking_end_marker
from rltrain.rollout import build_rollout
from rltrain.rollout.ahead import RolloutWorker
from rltrain.rollout.base import RolloutEngine
from rltrain.rollout.share import leads
from rltrain.runtime.precision import resolve_precision
from rltrain.safety.parity import parity_limit
from rltrain.sync.timeshare import TimeSharing
from rltrain.sync.weight_sync import WeightSync


@dataclass(frozen=True)
class RLParts:
    """What an RL algorithm's step runs on."""

    spec: AlgorithmSpec
    policy: TrainEngine
    reference: LogProbScorer | None  # the frozen reference, or distillation's teacher
    critic: TrainEngine | None
    rollout: RolloutEngine
    weights: WeightSync
    timeshare: TimeSharing
    collector: ExperienceCollector
    ahead: AsyncRollouts | None  # the schedule generating ahead (placement.max_staleness >= 1)
    inflight: InFlightRollouts | None  # weights loaded between decoding steps (placement.weight_update=in_flight)
    learner: Learner
    parity_limit: float | None  # None: no limit (safety.max_logprob_diff)


@dataclass(frozen=True)
class _Engines:
    policy: TrainEngine
    reference: LogProbScorer | None
    reference_engine: TrainEngine | None  # the reference's own engine (none for a LoRA policy's base)
    critic: TrainEngine | None
    rollout: RolloutEngine


class RLBuilder:
    """Builds an `RLParts` for the run `ctx`. `kl_in_loss` and `needs_old_logps_first` are the
    algorithm's answers (rltrain.algos.rl.RLAlgorithm): they shape the policy's loss and whether
    the training pass can score the batch itself."""

    def __init__(self, ctx: RunContext, built: ExitStack, kl_in_loss: bool, needs_old_logps_first: bool) -> None:
        self.ctx, self.cfg, self.built = ctx, ctx.cfg, built
        self.spec = spec_of(ctx.cfg.algo.name)
        self.kl_in_loss, self.needs_old_logps_first = kl_in_loss, needs_old_logps_first
        # The LR schedule spans every optimizer step the run will take.
        a = self.cfg.algo
        self.optimizer_steps = self.cfg.trainer.max_steps * a.mini_batches * a.num_iterations
        self.staleness = self.cfg.placement.max_staleness
        self.worker: RolloutWorker | None = None  # started by `sync_and_scoring` where k >= 1
        self.plays = True  # this rank leads its replica: it runs the reward functions and episodes

    def build(self) -> RLParts:
        engines = self.engines()
        weights, timeshare, scorer = self.sync_and_scoring(engines)
        collector = ExperienceCollector(self.ctx, engines.rollout, timeshare, engines.policy, scorer, self.episodes())
        precision = resolve_precision(self.cfg.trainer.precision, self.ctx.dist.device).name
        return RLParts(
            self.spec, engines.policy, engines.reference, engines.critic, engines.rollout, weights, timeshare,
            collector, self.generating_ahead(collector, engines.rollout), self.in_flight(collector, engines.rollout),
            self.learner(engines, collector),
            parity_limit(self.cfg.safety.max_logprob_diff, precision),
        )

    def engines(self) -> _Engines:
        """The policy, the reference (or teacher), the rollout engine and the critic, in this order."""
        ctx = self.ctx
        policy = build_engine(ctx, "policy", self.optimizer_steps)
        reference: LogProbScorer | None = None
        reference_engine = None
        if self.spec.builds_reference(self.cfg.algo):
            reference, reference_engine = build_reference(ctx, policy, self.cfg.trainer.max_steps)
        elif self.spec.teacher:  # scored where a reference would be: its log-probabilities arrive as `ref_logps`
            reference = reference_engine = build_engine(ctx, "teacher", self.cfg.trainer.max_steps)
        rollout = build_rollout(ctx)
        self.built.callback(rollout.close)
        critic = build_engine(ctx, "critic", self.optimizer_steps) if self.spec.critic else None
        return _Engines(policy, reference, reference_engine, critic, rollout)

    def sync_and_scoring(self, engines: _Engines) -> tuple[WeightSync, TimeSharing, RewardScorer]:
        """Weight sync, time sharing (which moves every trainer-side model and the reward
        functions' own models aside for the engine's turn) and the reward scorer."""
        cfg = self.cfg
        # env=python, agent, openenv and textarena: the environment (agent, game) gives the reward; reward.fns are not called.
        scored_here = cfg.env.name not in ("python", "agent", "openenv", "textarena")
        self.plays = leads(engines.policy.replica_group())  # a replica's peers receive scores and episodes
        reward_fns = (
            build_reward_fns(cfg, self.ctx.dist.device, Path(self.ctx.run_dir), self.ctx.dist.rank, scores=self.plays)
            if scored_here else []
        )
        frozen = [rf.device_model for rf in reward_fns if rf.device_model is not None]
        # k >= 1: the engine runs beside the trainer, driven by its own thread (docs/async.md).
        # In flight the engine's own loop takes versions as they come (rltrain/algos/rl/inflight_rollouts.py).
        self.worker = RolloutWorker() if self.staleness >= 1 and cfg.placement.weight_update != "in_flight" else None
        trained = [e for e in (engines.policy, engines.reference_engine, engines.critic) if e is not None]
        weights = WeightSync(engines.rollout, deferred=cfg.placement.time_sharing, worker=self.worker)
        timeshare = TimeSharing(trained, engines.rollout, self.ctx.dist.device, cfg.placement.time_sharing, weights, frozen)
        thinking_end = thinking_end_marker(self.ctx.tokenizer, cfg.reward.thinking_end)
        scorer = RewardScorer(reward_fns, cfg.reward, cfg.safety.collective_timeout_s, start_workers=self.plays, thinking_end=thinking_end)
        self.built.callback(scorer.close)
        return weights, timeshare, scorer

    def episodes(self) -> EpisodeRunner | AgentRunner | None:
        """The environment's episodes (None without one); the worker is registered after them so it
        closes first: a call it runs may use the episodes' workers."""
        processor = load_processor(self.ctx.model_dir, self.ctx.tokenizer)  # images in episodes (None: text-only)
        episodes = build_episode_runner(self.cfg, self.ctx.tokenizer, start_workers=self.plays, processor=processor)
        if episodes is not None:
            self.built.callback(episodes.close)
        if self.worker is not None:
            self.built.callback(self.worker.close)
        return episodes

    def generating_ahead(self, collector: ExperienceCollector, rollout: RolloutEngine) -> AsyncRollouts | None:
        """The schedule of batches generated ahead; each engine call is bounded by
        rollout.timeout_s, so a wait spans k + 2 of them."""
        if self.worker is None:
            return None
        k, cfg = self.staleness, self.cfg
        return AsyncRollouts(collector, rollout, self.worker, k, cfg.trainer.max_steps, cfg.rollout.timeout_s * (k + 2), self.ctx.dist.rank)

    def in_flight(self, collector: ExperienceCollector, rollout: RolloutEngine) -> InFlightRollouts | None:
        """The trainer's side of an engine that loads versions between decoding steps (the separate
        engine, or the server fleet: rltrain/rollout/server/stream.py; validation refuses any other)."""
        cfg = self.cfg
        if cfg.placement.weight_update != "in_flight":
            return None
        evaluated = evaluated_versions(cfg.trainer.eval_every, cfg.trainer.max_steps) if collector.eval_prompts else []
        return InFlightRollouts(collector, cast(StreamingEngine, rollout), cfg.placement, cfg.trainer.max_steps, evaluated)

    def learner(self, engines: _Engines, collector: ExperienceCollector) -> Learner:
        a, trainer = self.cfg.algo, self.cfg.trainer
        parity = ParityProbe()
        update = MiniBatchUpdate(
            collector.layout, a.mini_batches, a.num_iterations, trainer.micro_batch_size, trainer.max_tokens_per_micro_batch
        )
        # On-policy with one optimizer step per batch: old log-probabilities, entropy and the
        # parity check come from the training pass itself (same weights, before the update), which
        # saves a forward over the whole batch every step.
        fused = a.num_iterations == 1 and a.mini_batches == 1 and not self.needs_old_logps_first
        loss_fn = make_policy_loss(a, parity, kl_in_loss=self.kl_in_loss, max_staleness=self.staleness)
        return Learner(engines.policy, update, loss_fn, parity, fused, engines.reference, engines.critic)
