"""Proximal Policy Optimisation with a critic: the shared RL step (rltrain/algos/rl/algorithm.py) with
per-token advantages from GAE (rltrain/algos/advantages.py) and a value model trained alongside.

The critic gives credit per token instead of per completion; this module only adds what that
needs (values, token rewards, the critic's update) to the shared step. The step, its keys and
the critic warm-up: docs/internals/algos.md.

    python -m rltrain algo=ppo
    python -m rltrain algo=ppo backend=megatron backend.tp=2 trainer.nproc=2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.algos.advantages import (
    explained_variance,
    explained_variance_sums,
    gae,
    moments,
    moments_sums,
    on_sampled,
    scatter_sampled,
    token_rewards,
    whiten,
)
from rltrain.algos.rl.algorithm import Advantages, RLAlgorithm
from rltrain.algos.rl.config import RLConfig, check_rl
from rltrain.algos.rl.experience import Experience, sequence_scores
from rltrain.algos.rl.update import ValueLossInputs
from rltrain.backends.base import PolicyOutput
from rltrain.config.algorithms import AlgorithmSpec
from rltrain.config.run_context import RunContext
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged
from rltrain.data.sharding import sum_over_replicas
from rltrain.runtime.errors import UserError


@dataclass
class PPOConfig(RLConfig):
    name: str = "ppo"
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    vf_clip: float = 0.2  # clipped value loss: values move at most this far from the old ones
    critic_warmup_steps: int = 0  # the first steps train the critic only
    whiten_advantages: bool = True
    kl_in_reward: bool = False  # true: -beta * KL per token in the reward; false: beta * k3 in the loss


def check_ppo(algo: PPOConfig) -> None:
    check_rl(algo)
    if not (0 <= algo.gamma <= 1 and 0 <= algo.lam <= 1):
        raise UserError(f"algo.gamma={algo.gamma} and algo.lam={algo.lam} must be in [0, 1] (GAE).")
    if algo.vf_clip <= 0 or algo.critic_warmup_steps < 0:
        raise UserError(
            f"algo.vf_clip={algo.vf_clip} must be positive and algo.critic_warmup_steps={algo.critic_warmup_steps} at least 0."
        )


def value_loss(
    values: Ragged, old_values: Ragged, returns: Ragged, vf_clip: float, global_tokens: float, sampled: Ragged | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this micro-batch's share of the clipped value loss, metric contributions). With `sampled`
    (a multi-turn batch) only the policy's tokens count; `global_tokens` then counts those."""
    global_tokens = max(float(global_tokens), 1.0)
    v_N = values.values.float()
    device = v_N.device
    old_N = old_values.values.float().detach().to(device)
    ret_N = returns.values.float().detach().to(device)
    unclipped_N = (v_N - ret_N) ** 2
    clipped_v_N = old_N + torch.clamp(v_N - old_N, -vf_clip, vf_clip)
    clipped_N = (clipped_v_N - ret_N) ** 2
    loss_N = 0.5 * torch.maximum(unclipped_N, clipped_N)
    clipped_frac_N = (clipped_N > unclipped_N).float()
    if sampled is not None:  # observation tokens are context: no share of the loss
        keep_N = sampled.values.to(device=device, dtype=v_N.dtype)
        loss_N, clipped_frac_N = loss_N * keep_N, clipped_frac_N * keep_N
    loss = loss_N.sum() / global_tokens
    return loss, {
        "critic/value_loss": loss.detach(),
        "critic/vf_clipfrac": clipped_frac_N.sum().detach() / global_tokens,
    }


def make_value_loss(vf_clip: float):
    """The critic's loss for `train_step`, reading the batch's `ValueLossInputs` (host)."""

    def loss_fn(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert output.values is not None, "the value loss needs a critic's values"
        assert isinstance(batch.loss_inputs, ValueLossInputs), "the value loss needs ValueLossInputs"
        e = batch.loss_inputs.to(output.values.values.device)
        return value_loss(output.values, e.old_values, e.returns, vf_clip, e.global_tokens, batch.sampled)

    return loss_fn


def ppo_advantages(exp: Experience, algo_cfg: PPOConfig, dp_size: int) -> Advantages:
    """This rank's whitened GAE advantages and the critic's targets (the returns) from the
    experience's scores, values and, with the KL in the reward, old and reference log-probabilities;
    moments and explained variance over the global batch (a collective over `dp_size` replicas)."""
    a = algo_cfg
    # Multi-turn episodes: rewards, values and GAE run over the tokens the policy sampled, each
    # episode's in order (observation tokens are context, not actions), then land back in place.
    sampled = exp.batch.sampled
    template = exp.engine_logps  # ragged over the completion tokens
    kl_N = None
    if a.kl_in_reward and a.beta != 0:
        assert exp.old_logps is not None and exp.ref_logps is not None, "a KL in the reward needs old and reference log-probabilities"
        kl = exp.old_logps.with_values((exp.old_logps.values.float() - exp.ref_logps.values.float().to(exp.old_logps.values.device)).cpu())
        kl_N = on_sampled(kl, sampled).values
    values = exp.values if exp.values is not None else template.with_values(torch.zeros(template.num_tokens, device="cpu"))
    values = on_sampled(values, sampled)
    rewards = token_rewards(sequence_scores(exp.scores_B, exp.episode_of), on_sampled(template, sampled), kl_N, a.beta)
    adv, returns = gae(rewards, values, a.gamma, a.lam)
    adv_mean, adv_var = moments(sum_over_replicas(moments_sums(adv.values), dp_size))
    value_mean, _ = moments(sum_over_replicas(moments_sums(values.values), dp_size))
    ev = explained_variance(sum_over_replicas(explained_variance_sums(returns.values, values.values), dp_size))
    if a.whiten_advantages:
        adv = adv.with_values(whiten(adv.values, adv_mean, adv_var))
    adv, returns = scatter_sampled(adv, sampled, template), scatter_sampled(returns, sampled, template)
    metrics = {
        "adv/mean": adv_mean,
        "adv/std": adv_var**0.5,
        "critic/values_mean": value_mean,
        "critic/explained_variance": ev,
    }
    return Advantages(adv, metrics, returns)


class PPO(RLAlgorithm):
    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.value_loss_fn = make_value_loss(self.algo_cfg.vf_clip)

    def kl_in_loss(self) -> bool:
        return not self.algo_cfg.kl_in_reward

    def needs_old_logps_first(self) -> bool:
        return self.algo_cfg.kl_in_reward and self.algo_cfg.beta != 0

    def updates_policy(self, step: int) -> bool:
        return step > self.algo_cfg.critic_warmup_steps

    def advantages(self, exp: Experience) -> Advantages:
        return ppo_advantages(exp, self.algo_cfg, self.policy.world_size)

    def update_critic(self, exp: Experience, advantages: Advantages, step: int) -> dict[str, float]:
        assert advantages.returns is not None, "PPO's advantages come with the critic's targets"
        return self.learner.update_critic(exp, advantages.returns, self.value_loss_fn)


SPEC = AlgorithmSpec(
    "ppo", PPOConfig, PPO, "PPO with a critic (GAE, clipped value loss)",
    data="prompts", generates=True, rewards=True, reference="when_beta", critic=True, check=check_ppo,
)
