"""The update half of an RL step: mini-batches x iterations of optimizer steps on one engine, and
the policy's loss function (shared by GRPO and PPO; the critic's update runs through the same loop).

Mini-batches split the *global* batch by position (rltrain.algos.rl.experience.BatchLayout), so the
split does not depend on the number of ranks; each rank trains on its sequences that fall in the
mini-batch, in as many micro-batches as the rank holding the most of them needs. What the losses
read besides the model's output (`PolicyBatchInputs`, `ValueLossInputs`) travels with the
micro-batches as `SequenceBatch.loss_inputs`, on the host; the losses move it to the outputs' device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rltrain.algos.policy_loss import PolicyLossInputs, policy_loss
from rltrain.algos.rl.batch_layout import BatchLayout
from rltrain.algos.rl.config import RLConfig
from rltrain.algos.rl.experience import Experience
from rltrain.algos.rollout_correction import (
    CorrectionBands,
    clamped_tokens,
    correction,
    correction_metrics,
    mismatch_kl_sum,
    ratio_max,
    resolve_mode,
)
from rltrain.backends.base import LogProbScorer, LossFn, LossMetrics, PolicyOutput, TrainEngine
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged, on_device
from rltrain.data.sharding import split_micro_batches, sum_over_replicas
from rltrain.runtime.distributed import global_max


def _pick(value, idx: torch.Tensor):
    """The sequences at `idx` of a per-sequence tensor or a Ragged (None stays None)."""
    if isinstance(value, Ragged):
        return value.select(idx) if len(idx) else value.like_empty()
    if isinstance(value, torch.Tensor):
        return value[idx] if len(idx) else value[:0]
    return value


@dataclass
class PolicyBatchInputs:
    """What the policy's loss reads besides the model's output, per sequence of its batch.
    None means on-policy scoring from the training pass itself (see `make_policy_loss`)."""

    adv: torch.Tensor | Ragged  # [B] per sequence (GRPO) or per completion token (PPO)
    engine_logps: Ragged  # the rollout engine's sampling log-probabilities
    old_logps: Ragged | None = None
    entropy: Ragged | None = None
    ref_logps: Ragged | None = None
    measure_parity: bool = False  # the loss measures train/rollout parity (the fused pass)
    global_tokens: float = 0.0  # completion tokens of the mini-batch over every rank
    global_seqs: float = 0.0  # sequences of the mini-batch over every rank

    def select(self, indices: torch.Tensor) -> PolicyBatchInputs:
        return replace(
            self, adv=_pick(self.adv, indices), engine_logps=_pick(self.engine_logps, indices),
            old_logps=_pick(self.old_logps, indices), entropy=_pick(self.entropy, indices),
            ref_logps=_pick(self.ref_logps, indices),
        )

    def to(self, device: torch.device) -> PolicyBatchInputs:
        return replace(
            self, adv=self.adv.to(device), engine_logps=self.engine_logps.to(device),
            old_logps=on_device(self.old_logps, device), entropy=on_device(self.entropy, device),
            ref_logps=on_device(self.ref_logps, device),
        )


@dataclass
class ValueLossInputs:
    """What the critic's loss reads besides the critic's values, per sequence of its batch."""

    old_values: Ragged  # the critic's values when the batch was scored
    returns: Ragged  # the targets (GAE returns)
    global_tokens: float = 0.0
    global_seqs: float = 0.0

    def select(self, indices: torch.Tensor) -> ValueLossInputs:
        return replace(self, old_values=_pick(self.old_values, indices), returns=_pick(self.returns, indices))

    def to(self, device: torch.device) -> ValueLossInputs:
        return replace(self, old_values=self.old_values.to(device), returns=self.returns.to(device))


LossInputsT = PolicyBatchInputs | ValueLossInputs


def sampled_gap(trainer_N: torch.Tensor, engine_N: torch.Tensor, sampled: Ragged | None) -> torch.Tensor:
    """|trainer - engine| log-probability per completion token, 0 on an environment's observation
    tokens (the engine sampled none of them: docs/environments.md)."""
    gap_N = (trainer_N.float() - engine_N.float().to(trainer_N.device)).abs()
    return gap_N if sampled is None else gap_N * sampled.values.to(gap_N.device, gap_N.dtype)


class ParityProbe:
    """The largest |engine - trainer| log-probability gap and the largest importance ratio seen by
    the loss function this step. A max cannot travel with the summed metrics of `train_step`, so
    the loss reports it here and the step reduces it over ranks (MAX); under pipeline parallelism
    only the last stage sees any. The running maxima stay device tensors, read once per step
    (`max_diff`, `max_ratio`): a read per micro-batch would wait on the device each time."""

    def __init__(self) -> None:
        self._diff: torch.Tensor | None = None
        self._ratio: torch.Tensor | None = None

    def reset(self) -> None:
        self._diff = self._ratio = None

    def observe(self, diffs_N: torch.Tensor) -> None:
        if diffs_N.numel():
            self._diff = _running_max(self._diff, diffs_N.max())

    def observe_ratio(self, ratio: torch.Tensor) -> None:
        self._ratio = _running_max(self._ratio, ratio)

    @property
    def max_diff(self) -> float:
        return 0.0 if self._diff is None else max(0.0, float(self._diff))

    @property
    def max_ratio(self) -> float:
        return 0.0 if self._ratio is None else max(0.0, float(self._ratio))


def _running_max(running: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    value = value.detach()
    return value if running is None else torch.fmax(running, value.to(running.device))  # a NaN is skipped, as max() skipped it


def correction_bands(algo_cfg: RLConfig) -> CorrectionBands:
    geo_low, geo_high = algo_cfg.rollout_geo_band
    icepop_low, icepop_high = algo_cfg.rollout_icepop_band
    return CorrectionBands(algo_cfg.rollout_is_floor, geo_low, geo_high, icepop_low, icepop_high)


def make_policy_loss(
    algo_cfg: RLConfig, parity: ParityProbe | None = None, kl_in_loss: bool = True, max_staleness: int = 0
) -> LossFn:
    """The policy's loss for `train_step`, reading the batch's `PolicyBatchInputs`. Inputs set to
    None mean on-policy scoring from the training pass itself: `old_logps` -> the pass's own detached log-probabilities (ratio 1),
    `entropy` -> the pass's entropies, `ref_logps` (without a reference model) -> the old
    log-probabilities, so `policy/kl` reads 0. With `engine_logps` the loss applies the rollout
    correction (`algo.rollout_correction`) and, when `measure_parity` is set, measures
    train/rollout parity. `kl_in_loss=False` (PPO's KL in the reward): `beta` is not applied here.
    `max_staleness` picks what `rollout_correction=auto` means (rollout_correction.resolve_mode)."""
    beta = algo_cfg.beta if kl_in_loss else 0.0
    mode = resolve_mode(algo_cfg.rollout_correction, max_staleness)
    bands = correction_bands(algo_cfg)

    def loss_fn(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, LossMetrics]:
        assert output.logps is not None, "the policy's loss needs log-probabilities"
        assert isinstance(batch.loss_inputs, PolicyBatchInputs), "the policy's loss needs PolicyBatchInputs"
        # The inputs are built on the host; the loss runs where the model's outputs are.
        e = batch.loss_inputs.to(output.logps.values.device)
        old = e.old_logps if e.old_logps is not None else output.logps.detach()
        ref = e.ref_logps if e.ref_logps is not None else old
        engine_logps = e.engine_logps
        sampled = batch.sampled.to(output.logps.values.device) if batch.sampled is not None else None
        weights, keep_B = correction(
            old, engine_logps, mode, algo_cfg.rollout_is_cap, algo_cfg.rollout_mask_band, sampled, bands
        )
        loss, loss_metrics = policy_loss(PolicyLossInputs(
            output.logps,
            e.adv,
            old_logps=old,
            ref_logps=ref,
            entropy=e.entropy if e.entropy is not None else output.entropy,
            is_weights=weights,
            keep_B=keep_B,
            clip_low=algo_cfg.clip_low,
            clip_high=algo_cfg.clip_high,
            beta=beta,
            loss_agg=algo_cfg.loss_agg,
            importance_level=algo_cfg.importance_level,
            kind=algo_cfg.policy_loss,
            global_tokens=e.global_tokens,
            global_seqs=e.global_seqs,
            max_len=algo_cfg.max_new_tokens,
            sampled=sampled,
        ))
        metrics: dict[str, torch.Tensor | float] = dict(loss_metrics)
        metrics.update(correction_metrics(weights, keep_B, batch.num_sampled_tokens, e.global_tokens, e.global_seqs, sampled))
        metrics["rollout/mismatch_kl"] = mismatch_kl_sum(old, engine_logps, sampled) / max(float(e.global_tokens), 1.0)
        metrics["rollout/clamped_tokens"] = clamped_tokens(old, engine_logps, sampled)
        if parity is not None:
            parity.observe_ratio(ratio_max(old, engine_logps, mode, sampled))
        if e.measure_parity:
            diffs_N = sampled_gap(output.logps.values.detach(), engine_logps.values, sampled)
            metrics["rollout/logprob_diff_mean"] = diffs_N.sum() / max(float(e.global_tokens), 1.0)
            if parity is not None:
                parity.observe(diffs_N)
        return loss, metrics

    return loss_fn


class MiniBatchUpdate:
    """`num_iterations` passes over `mini_batches` mini-batches of the global batch, one optimizer
    step of `engine` each; returns the metrics averaged over those steps."""

    def __init__(self, layout: BatchLayout, mini_batches: int, num_iterations: int, micro_batch_size: int, token_budget: int) -> None:
        self.layout = layout
        self.mini_batches, self.num_iterations = mini_batches, num_iterations
        self.micro_batch_size, self.token_budget = micro_batch_size, token_budget

    def micro_batches(self, batch: SequenceBatch, episode_of: list[int] | None = None) -> list[SequenceBatch]:
        """The whole batch in the micro-batches every rank agrees on (for scoring passes)."""
        count = self.layout.micro_batches_per_rank(0, self.layout.global_size, self.micro_batch_size)
        if episode_of is not None:
            count = self._agreed(count, len(batch))
        return [batch.select(p) for p in self._split(list(range(len(batch))), count, batch)]

    def _agreed(self, count: int, held: int) -> int:
        """env=agent: an episode may train several sequences, so a rank may hold more than its share
        of the layout; every rank takes as many micro-batches as the one that holds the most (a
        collective: every rank of an agent run calls this together)."""
        return max(count, int(global_max(float(-(-held // self.micro_batch_size)))))

    def _split(self, positions: list[int], count: int, batch: SequenceBatch) -> list[list[int]]:
        return split_micro_batches(positions, count, self.micro_batch_size, batch.tokens.lengths().tolist(), self.token_budget)

    def run(
        self, engine: TrainEngine, batch: SequenceBatch, inputs: LossInputsT, loss_fn: LossFn, with_entropy: bool = False,
        on_step: Callable[[], None] | None = None, episode_of: list[int] | None = None,
    ) -> dict[str, float]:
        """`episode_of`: env=agent's episode of each sequence (a sequence sits at its episode's
        global position; None: sequence i is episode i)."""
        offset = self.layout.offset
        where = [offset + (episode_of[i] if episode_of is not None else i) for i in range(len(batch))]
        per_mini = -(-self.layout.global_size // self.mini_batches)
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(self.num_iterations):
            for mini in range(self.mini_batches):
                lo, hi = mini * per_mini, (mini + 1) * per_mini
                mine = [i for i in range(len(batch)) if lo <= where[i] < hi]
                count = self.layout.micro_batches_per_rank(lo, hi, self.micro_batch_size)
                if episode_of is not None:
                    count = self._agreed(count, len(mine))
                metrics = self._train_on(engine, batch, mine, inputs, loss_fn, count, with_entropy)
                updates += 1
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                if on_step is not None:
                    on_step()
        return {k: v / updates for k, v in sums.items()}

    def _train_on(
        self, engine: TrainEngine, batch: SequenceBatch, positions: list[int], inputs: LossInputsT, loss_fn: LossFn,
        count: int, with_entropy: bool,
    ) -> dict[str, float]:
        sub = batch.select(positions)
        counts = sum_over_replicas(
            torch.tensor([float(sub.num_sampled_tokens), float(len(sub))], dtype=torch.float64, device="cpu"), engine.world_size
        )
        mine = inputs.select(torch.as_tensor(positions, dtype=torch.long, device="cpu"))
        sub.loss_inputs = replace(mine, global_tokens=float(counts[0]), global_seqs=float(counts[1]))
        micro = [sub.select(p) for p in self._split(list(range(len(sub))), count, sub)]
        return engine.train_step(micro, loss_fn, with_entropy=with_entropy)


class Learner:
    """The trainer's side of an RL step on an `Experience`: scoring it once (old log-probabilities
    and entropies unless the training pass provides them, the reference's log-probabilities, the
    critic's values) and the policy's optimizer steps. `fused`: the policy's scoring *is* its
    training pass (one iteration, one mini-batch, nothing needed before the update)."""

    def __init__(
        self, policy: TrainEngine, update: MiniBatchUpdate, loss_fn: LossFn, parity: ParityProbe, fused: bool,
        reference: LogProbScorer | None = None, critic: TrainEngine | None = None,
    ) -> None:
        self.policy, self.reference, self.critic = policy, reference, critic
        self.update, self.loss_fn, self.parity, self.fused = update, loss_fn, parity, fused

    def score(self, exp: Experience) -> None:
        """Fill the experience's trainer-side fields this learner needs (a collective: every rank)."""
        self.parity.reset()
        batch = exp.batch
        need_micro = not self.fused or self.reference is not None or self.critic is not None
        micro = self.update.micro_batches(batch, exp.episode_of) if need_micro else []
        if not self.fused:
            scored = self.policy.forward_logps(micro, with_entropy=True)
            exp.old_logps = Ragged.cat([s.policy_logps() for s in scored]) if len(batch) else None
            exp.entropy = Ragged.cat([s.policy_entropy() for s in scored]) if len(batch) else None
            if exp.old_logps is not None:
                self.parity.observe(sampled_gap(exp.old_logps.values, exp.engine_logps.values, batch.sampled))
        if self.reference is not None:
            ref_scored = self.reference.forward_logps(micro)
            exp.ref_logps = Ragged.cat([s.policy_logps() for s in ref_scored]) if len(batch) else None
        if self.critic is not None:
            values = self.critic.forward_values(micro)
            exp.values = Ragged.cat(values).to("cpu") if len(batch) else exp.engine_logps.like_empty()

    def update_policy(self, exp: Experience, adv: torch.Tensor | Ragged) -> dict[str, float]:
        """The policy's optimizer steps on `exp` with advantages `adv` ([B] or per token)."""
        inputs = PolicyBatchInputs(
            adv=adv, engine_logps=exp.engine_logps, old_logps=exp.old_logps, entropy=exp.entropy,
            ref_logps=exp.ref_logps, measure_parity=self.fused,
        )
        out = self.update.run(self.policy, exp.batch, inputs, self.loss_fn, with_entropy=self.fused, episode_of=exp.episode_of)
        # A count per mini-batch, averaged over the updates like every metric: each pass over the
        # mini-batches counts the batch once, so mini_batches times the average is the batch's count.
        if "rollout/clamped_tokens" in out:  # (absent when every micro-batch's loss failed and was replaced)
            out["rollout/clamped_tokens"] *= self.update.mini_batches
        out["rollout/logprob_diff_max"] = global_max(self.parity.max_diff)
        out["rollout/is_ratio_max"] = global_max(self.parity.max_ratio)
        if not self.fused:
            old = exp.old_logps
            diffs_sum = sampled_gap(old.values, exp.engine_logps.values, exp.batch.sampled).sum() if old is not None else 0.0
            diff_sum = sum_over_replicas(torch.tensor([float(diffs_sum)], dtype=torch.float64, device="cpu"), self.policy.world_size)
            out["rollout/logprob_diff_mean"] = float(diff_sum[0] / max(float(exp.counts[3]), 1.0))
        return out

    def update_critic(self, exp: Experience, returns: Ragged, loss_fn: LossFn) -> dict[str, float]:
        """The critic's optimizer steps on `exp` towards `returns`, metrics under `critic/`."""
        assert self.critic is not None and exp.values is not None
        inputs = ValueLossInputs(old_values=exp.values, returns=returns)
        stats = self.update.run(self.critic, exp.batch, inputs, loss_fn, episode_of=exp.episode_of)
        return {k if k.startswith("critic/") else f"critic/{k}": v for k, v in stats.items() if k != "loss"}
