"""PPO's pure functions against values computed by hand (rltrain/algos/advantages.py)."""

from __future__ import annotations

import pytest
import torch

from rltrain.algos.advantages import (
    explained_variance,
    explained_variance_sums,
    gae,
    moments,
    moments_sums,
    token_rewards,
    whiten,
)
from rltrain.algos.ppo import value_loss
from rltrain.data.ragged import Ragged


def _ragged(values, lengths):
    return Ragged.from_lengths(torch.tensor(values, dtype=torch.float32), lengths)


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    template = _ragged([0.0] * 5, [3, 0, 2])
    r = token_rewards(torch.tensor([1.0, 7.0, -2.0], dtype=torch.float64), template)
    assert r.values.tolist() == [0.0, 0.0, 1.0, 0.0, -2.0]  # the empty completion has no token to reward
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    r = token_rewards(torch.tensor([1.0, 7.0, -2.0]), template, kl, kl_coef=0.5)
    assert r.values.tolist() == pytest.approx([-0.05, -0.1, 1.0 - 0.15, -0.2, -2.0 - 0.25])


def test_gae_by_hand():
    # One sequence of 3 tokens: r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lambda 0.8.
    # delta_2 = 1 + 0 - 0.7 = 0.3; delta_1 = 0 + 0.9*0.7 - 0.6 = 0.03; delta_0 = 0.9*0.6 - 0.5 = 0.04
    # A_2 = 0.3; A_1 = 0.03 + 0.72*0.3 = 0.246; A_0 = 0.04 + 0.72*0.246 = 0.21712
    # A second sequence of 1 token: r = [2], V = [1.5] -> A = 0.5. An empty one in between.
    rewards = _ragged([0.0, 0.0, 1.0, 2.0], [3, 0, 1])
    values = _ragged([0.5, 0.6, 0.7, 1.5], [3, 0, 1])
    adv, ret = gae(rewards, values, gamma=0.9, lam=0.8)
    assert adv.values.tolist() == pytest.approx([0.21712, 0.246, 0.3, 0.5], abs=1e-6)
    assert ret.values.tolist() == pytest.approx([0.71712, 0.846, 1.0, 2.0], abs=1e-6)
    assert adv.lengths().tolist() == [3, 0, 1]


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    rewards = _ragged([0.0, 0.0, 3.0], [3])
    values = _ragged([1.0, 2.0, 0.5], [3])
    adv, ret = gae(rewards, values, gamma=1.0, lam=1.0)
    assert ret.values.tolist() == pytest.approx([3.0, 3.0, 3.0])
    assert adv.values.tolist() == pytest.approx([2.0, 1.0, 2.5])


def test_whitening_uses_the_global_moments():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    # Two "ranks" holding halves: summed moments equal the whole batch's.
    sums = moments_sums(x[:2]) + moments_sums(x[2:])
    mean, var = moments(sums)
    assert (mean, var) == pytest.approx((3.0, 3.5))  # biased variance: (4 + 1 + 0 + 9) / 4
    assert whiten(x, mean, var).tolist() == pytest.approx([(v - 3.0) / 3.5**0.5 for v in x.tolist()], abs=1e-6)


def test_clipped_value_loss_by_hand():
    # old V = 0; returns 1; new V = 0.5 (clipped to 0.2) and -0.1 (inside the clip range).
    # token 0: unclipped (0.5-1)^2 = 0.25, clipped (0.2-1)^2 = 0.64 -> 0.5*0.64 = 0.32 (clipped active)
    # token 1: unclipped (-0.1-1)^2 = 1.21 = clipped -> 0.605
    values = Ragged.from_lengths(torch.tensor([0.5, -0.1], requires_grad=True), [2])
    old, ret = _ragged([0.0, 0.0], [2]), _ragged([1.0, 1.0], [2])
    loss, metrics = value_loss(values, old, ret, vf_clip=0.2, global_tokens=4.0)
    assert loss.item() == pytest.approx((0.32 + 0.605) / 4)
    assert metrics["critic/vf_clipfrac"].item() == pytest.approx(1 / 4)
    loss.backward()
    # the clipped token has no gradient; the other: d/dv 0.5 (v-1)^2 / 4 = (v-1)/4
    assert values.values.grad.tolist() == pytest.approx([0.0, -1.1 / 4])


def test_explained_variance():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(explained_variance_sums(returns, returns)) == pytest.approx(1.0)
    assert explained_variance(explained_variance_sums(returns, torch.zeros(4))) == pytest.approx(0.0)
    # V = R + noise with Var(noise) = 0.25, Var(R) = 1.25 -> 1 - 0.25/1.25 = 0.8
    values = returns + torch.tensor([0.5, -0.5, 0.5, -0.5])
    sums = explained_variance_sums(returns[:2], values[:2]) + explained_variance_sums(returns[2:], values[2:])
    assert explained_variance(sums) == pytest.approx(0.8)


def test_multi_turn_gae_runs_over_the_sampled_tokens_and_leaves_observations_out():
    """An episode [s, s, o, o, s] (o: observation tokens): rewards, values and GAE are those of the
    sampled tokens alone, [s, s, s], each back in its place; the observations get advantage 0 and
    no share of the value loss, and the whitening moments count sampled tokens only."""
    from types import SimpleNamespace

    from rltrain.algos.ppo import PPOConfig, ppo_advantages

    sampled = Ragged.from_lengths(torch.tensor([True, True, False, False, True, True, True]), [5, 2])
    values = _ragged([0.5, 0.6, 9.0, 9.0, 0.7, 1.0, 1.5], [5, 2])
    engine = _ragged([0.0] * 7, [5, 2])
    cfg = PPOConfig(gamma=0.9, lam=0.8, whiten_advantages=False, kl_in_reward=False)
    exp = SimpleNamespace(batch=SimpleNamespace(sampled=sampled), engine_logps=engine, values=values,
                          scores_B=torch.tensor([1.0, 2.0], dtype=torch.float64), old_logps=None, ref_logps=None, episode_of=None)
    out = ppo_advantages(exp, cfg, dp_size=1)
    # The first episode's sampled tokens are test_gae_by_hand's sequence: A = [0.21712, 0.246, 0.3].
    # The second, r = [0, 2], V = [1.0, 1.5]: A_1 = 0.5, A_0 = 0.9 * 1.5 - 1.0 + 0.72 * 0.5 = 0.71.
    assert out.adv.values.tolist() == pytest.approx([0.21712, 0.246, 0.0, 0.0, 0.3, 0.71, 0.5], abs=1e-6)
    assert out.returns.values.tolist() == pytest.approx([0.71712, 0.846, 0.0, 0.0, 1.0, 1.71, 2.0], abs=1e-6)
    assert out.metrics["critic/values_mean"] == pytest.approx((0.5 + 0.6 + 0.7 + 1.0 + 1.5) / 5)
    # The value loss: the observation tokens' (huge) errors count for nothing.
    new = _ragged([0.5, 0.6, 100.0, -100.0, 0.7, 1.0, 1.5], [5, 2])
    masked, _ = value_loss(new, values, out.returns, vf_clip=10.0, global_tokens=5, sampled=sampled)
    keep = sampled.values
    alone, _ = value_loss(
        Ragged.from_lengths(new.values[keep], [3, 2]), Ragged.from_lengths(values.values[keep], [3, 2]),
        Ragged.from_lengths(out.returns.values[keep], [3, 2]), vf_clip=10.0, global_tokens=5,
    )
    assert float(masked) == pytest.approx(float(alone)) and float(alone) > 0
