"""GRPO advantages and loss against hand-computed values."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from rltrain.algos.advantages import group_advantages
from rltrain.algos.grpo import GRPO
from rltrain.algos.policy_loss import PolicyLossInputs, aggregate, k3_kl
from rltrain.algos.policy_loss import policy_loss as grpo_loss
from rltrain.data.ragged import Ragged


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: constant -> 0
    a = 0.5 / math.sqrt(1 / 3)
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(
        [a, -a, -a, a, 0, 0, 0, 0], abs=1e-5
    )
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # batch std of the raw rewards: mean 1.25, sum of squared deviations 5.5, n-1 = 7
    b = 0.5 / math.sqrt(5.5 / 7)
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx(
        [b, -b, -b, b, 0, 0, 0, 0], abs=1e-5
    )


def test_group_advantages_edge_cases():
    assert group_advantages(torch.tensor([3.0, 5.0]), 1, "group").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 2, "global")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("reward", [0.7, 0.1, 1 / 3])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(scale, reward):
    # float32's mean of eight 0.7s is not 0.7: divided by a near-zero std, that rounding once gave
    # the whole group one sign (about 0.06). Beside it, a group with signal keeps its advantages.
    rewards = torch.tensor([reward] * 8 + [0.0, 1.0] * 4)
    adv = group_advantages(rewards, 8, scale)
    assert adv[:8].tolist() == [0.0] * 8
    assert (adv[8:] != 0).all()
    assert adv[8:].sum().abs() < 1e-5


def reference_advantages(rewards: list[float], group_size: int, scale: str, eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) from the formula, the mean and variance exact (fractions of the
    float64 rewards), the std unbiased."""
    def exact_std(values: list[float]) -> float:
        mean = sum(map(Fraction, values)) / len(values)
        return math.sqrt(sum((Fraction(v) - mean) ** 2 for v in values) / (len(values) - 1))

    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = sum(map(Fraction, group)) / group_size
        scale_by = {"group": exact_std(group), "batch": exact_std(rewards), "none": None}[scale]
        out += [float(Fraction(r) - mean) / (1.0 if scale_by is None else scale_by + eps) for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("gap", [1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3])
def test_near_tied_rewards_keep_their_order(scale, gap):
    # One reward above 31 equal ones (below float32's resolution at 0.99 from 1e-7 down), beside a
    # group with two near-tied levels: centred in float32 every member once got the same sign.
    rewards = [0.99] * 31 + [0.99 + gap] + [0.3 + gap * (i % 2) for i in range(32)]
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), 32, scale)
    assert adv.dtype == torch.float32
    expected = reference_advantages(rewards, 32, scale)
    for got, want in zip(adv.tolist(), expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=0.0)
    assert (adv[:31] < 0).all() and adv[31] > 0
    for group in adv.view(-1, 32):  # within 1e-6 x group size, and relative to the advantages' size below 1
        assert abs(float(group.double().sum())) <= 1e-6 * 32 * min(1.0, float(group.abs().max()))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_random_groups_sum_to_zero_and_follow_the_formula(scale):
    g = torch.Generator().manual_seed(0)
    for group_size in (2, 5, 16):
        base_G1 = torch.rand(6, 1, generator=g, dtype=torch.float64) * 10 - 5
        gaps_G1 = 10.0 ** -torch.randint(0, 10, (6, 1), generator=g).double()  # each group's spread, 1 .. 1e-9
        rewards = (base_G1 + gaps_G1 * torch.rand(6, group_size, generator=g, dtype=torch.float64)).reshape(-1)
        adv = group_advantages(rewards, group_size, scale)
        for got, want in zip(adv.tolist(), reference_advantages(rewards.tolist(), group_size, scale), strict=True):
            assert got == pytest.approx(want, rel=1e-6, abs=0.0), (group_size, scale)
        for group in adv.view(-1, group_size):
            assert abs(float(group.double().sum())) <= 1e-6 * group_size * min(1.0, float(group.abs().max()))


def test_grpo_takes_the_rewards_as_scored():
    """GRPO hands the float64 scores to `group_advantages` uncast (a cast to float32 first rounds
    0.99 + 1e-7 to 0.99's neighbour and every member of the group gets +0.106)."""
    stand_in = SimpleNamespace(algo_cfg=SimpleNamespace(group_size=32, scale_rewards="group"),
                               collector=SimpleNamespace(layout=SimpleNamespace(offset=0)))
    scores = torch.tensor([0.99] * 31 + [0.99 + 1e-7], dtype=torch.float64)
    exp = SimpleNamespace(global_scores=scores, scores_B=scores, episode_of=None)
    adv = GRPO.advantages(stand_in, exp).adv  # type: ignore[arg-type]
    assert adv.tolist() == pytest.approx(reference_advantages(scores.tolist(), 32, "group"), rel=1e-6)
    assert adv[0] == pytest.approx(-0.00307, rel=1e-3) and adv[31] == pytest.approx(0.0952, rel=1e-3)


def example():
    """Two completions: ratios (1.5, 0.5) with advantage +1, ratio 1.1 with advantage -2."""
    old = Ragged.from_lengths(torch.tensor([-1.0, -2.0, -0.5]), [2, 1])
    logps = old.with_values((old.values + torch.log(torch.tensor([1.5, 0.5, 1.1]))).requires_grad_())
    return logps, old, torch.tensor([1.0, -2.0])


# per token, clip 0.2 / 0.28: -min(1.5, 1.28) = -1.28 (clipped); -0.5 (a positive advantage is not
# clipped from below); +2 * 1.1 = 2.2 (inside the bounds)
PG = [-1.28, -0.5, 2.2]


@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        ("token_mean", sum(PG) / 3),
        ("seq_mean_token_mean", ((PG[0] + PG[1]) / 2 + PG[2]) / 2),
        ("seq_mean_token_sum_norm", ((PG[0] + PG[1]) / 4 + PG[2] / 4) / 2),
    ],
)
def test_loss_by_hand(loss_agg, expected):
    logps, old, adv = example()
    loss, metrics = grpo_loss(PolicyLossInputs(
        logps, adv, old_logps=old, loss_agg=loss_agg, global_tokens=3, global_seqs=2, max_len=4
    ))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["policy/pg_loss"].item() == pytest.approx(expected, abs=1e-6)
    assert metrics["policy/clipfrac"].item() == pytest.approx(1 / 3)
    assert "policy/kl" not in metrics and "policy/entropy" not in metrics


def test_gradient_by_hand():
    """d/dlogp of -A r is -A r, zero where the clipped bound is active."""
    logps, old, adv = example()
    loss, _ = grpo_loss(PolicyLossInputs(logps, adv, old_logps=old, global_tokens=3, global_seqs=2))
    loss.backward()
    assert logps.values.grad.tolist() == pytest.approx([0.0, -0.5 / 3, 2 * 1.1 / 3], abs=1e-6)


@pytest.mark.parametrize(
    "ratio, adv, clipped",
    [
        (0.75, -1.0, True),  # below 1 - 0.2 with a negative advantage: clipped
        (0.75, 1.0, False),  # below the bound but a positive advantage: the unclipped term is active
        (1.25, 1.0, False),  # above 1 + 0.2 but below the higher bound 1 + 0.28: not clipped
        (1.30, 1.0, True),  # above 1 + 0.28 with a positive advantage: clipped
        (1.30, -1.0, False),
    ],
)
def test_asymmetric_clip(ratio, adv, clipped):
    old = Ragged.from_lengths(torch.tensor([-1.0]), [1])
    logps = old.with_values(old.values + math.log(ratio))
    loss, metrics = grpo_loss(PolicyLossInputs(logps, torch.tensor([adv]), old_logps=old, global_tokens=1, global_seqs=1))
    bounded = min(max(ratio, 0.8), 1.28)
    assert loss.item() == pytest.approx(max(-adv * ratio, -adv * bounded), abs=1e-6)
    assert metrics["policy/clipfrac"].item() == float(clipped)


def test_k3_kl_and_beta():
    delta = -0.5
    k3 = math.exp(delta) - delta - 1  # 0.10653...
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-1.5])).item() == pytest.approx(k3, abs=1e-6)
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    logps, old, adv = example()
    ref = old.with_values(logps.values.detach() + delta)
    entropy = old.with_values(torch.tensor([1.0, 2.0, 3.0]))
    loss, metrics = grpo_loss(PolicyLossInputs(
        logps, adv, old_logps=old, ref_logps=ref, entropy=entropy, beta=0.1, global_tokens=3, global_seqs=2
    ))
    assert loss.item() == pytest.approx((sum(PG) + 3 * 0.1 * k3) / 3, abs=1e-6)
    assert metrics["policy/pg_loss"].item() == pytest.approx(sum(PG) / 3, abs=1e-6)
    assert metrics["policy/kl"].item() == pytest.approx(k3, abs=1e-6)
    assert metrics["policy/entropy"].item() == pytest.approx(2.0)
    # beta = 0: KL reported, not in the loss
    loss0, metrics0 = grpo_loss(PolicyLossInputs(logps, adv, old_logps=old, ref_logps=ref, global_tokens=3, global_seqs=2))
    assert loss0.item() == pytest.approx(sum(PG) / 3, abs=1e-6)
    assert metrics0["policy/kl"].item() == pytest.approx(k3, abs=1e-6)


def test_on_policy_is_reinforce_with_a_baseline():
    """old_logps=None: ratio 1, loss = -mean(A), gradient -A / N per token."""
    logps, _, adv = example()
    loss, metrics = grpo_loss(PolicyLossInputs(logps, adv, global_tokens=3, global_seqs=2))
    assert loss.item() == pytest.approx((-1 - 1 + 2) / 3, abs=1e-6)
    assert metrics["policy/clipfrac"].item() == 0.0
    loss.backward()
    assert logps.values.grad.tolist() == pytest.approx([-1 / 3, -1 / 3, 2 / 3], abs=1e-6)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_sum_to_the_full_batch(loss_agg):
    """With global normalisers, any split into micro-batches sums to the full-batch loss,
    metrics and gradient (including an empty completion and an empty micro-batch)."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 0, 5, 1, 4, 2]
    n = sum(lengths)
    old = Ragged.from_lengths(-torch.rand(n, generator=g) * 3, lengths)
    ref = old.with_values(old.values + 0.3 * torch.randn(n, generator=g))
    ent = old.with_values(torch.rand(n, generator=g))
    adv = torch.randn(len(lengths), generator=g)
    base = (old.values + 0.4 * torch.randn(n, generator=g)).requires_grad_()
    kw = dict(beta=0.05, loss_agg=loss_agg, global_tokens=n, global_seqs=len(lengths), max_len=6)

    full, full_m = grpo_loss(PolicyLossInputs(old.with_values(base), adv, old_logps=old, ref_logps=ref, entropy=ent, **kw))
    (full_grad,) = torch.autograd.grad(full, base)

    total, total_m = torch.zeros(()), {k: torch.zeros(()) for k in full_m}
    for idx in ([0, 1], [], [2, 3, 4], [5]):
        logps = old.with_values(base).select(idx)
        loss, m = grpo_loss(PolicyLossInputs(
            logps,
            adv[idx],
            old_logps=old.select(idx),
            ref_logps=ref.select(idx),
            entropy=ent.select(idx),
            **kw,
        ))
        total = total + loss
        total_m = {k: total_m[k] + m[k] for k in total_m}
    (split_grad,) = torch.autograd.grad(total, base)
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    for k in full_m:
        assert total_m[k].item() == pytest.approx(full_m[k].item(), abs=1e-6), k
    assert torch.allclose(split_grad, full_grad, atol=1e-7)


def test_aggregate_weights():
    """token_mean weighs tokens equally, seq_mean_token_mean weighs sequences equally."""
    per_token = Ragged.from_lengths(torch.tensor([1.0, 1.0, 1.0, 4.0]), [3, 1])
    assert aggregate(per_token, "token_mean", 4, 2).item() == pytest.approx(7 / 4)
    assert aggregate(per_token, "seq_mean_token_mean", 4, 2).item() == pytest.approx((1 + 4) / 2)
    assert aggregate(per_token, "seq_mean_token_sum_norm", 4, 2, max_len=8).item() == pytest.approx(
        (3 + 4) / 8 / 2
    )


def test_errors_name_the_setting():
    logps, old, adv = example()
    kw = dict(global_tokens=3, global_seqs=2)
    with pytest.raises(ValueError, match="loss_agg"):
        grpo_loss(PolicyLossInputs(logps, adv, loss_agg="seq_sum", **kw))
    with pytest.raises(ValueError, match="beta"):
        grpo_loss(PolicyLossInputs(logps, adv, beta=0.1, **kw))
    with pytest.raises(ValueError, match="max_len"):
        grpo_loss(PolicyLossInputs(logps, adv, loss_agg="seq_mean_token_sum_norm", **kw))
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(PolicyLossInputs(logps, adv[:1], **kw))


def test_token_advantages_equal_broadcast_sequence_advantages():
    """PPO's per-token advantages go through the same loss: a Ragged that repeats each sequence's
    advantage gives exactly the per-sequence loss."""
    logps = Ragged.from_lengths(torch.tensor([-1.0, -2.0, -0.5], requires_grad=True), [2, 1])
    old = Ragged.from_lengths(torch.tensor([-1.1, -1.9, -0.7]), [2, 1])
    adv = torch.tensor([0.7, -1.3])
    kw = dict(old_logps=old, global_tokens=3, global_seqs=2)
    per_seq, m_seq = grpo_loss(PolicyLossInputs(logps, adv, **kw))
    per_token, m_tok = grpo_loss(PolicyLossInputs(logps, logps.broadcast(adv).detach(), **kw))
    assert per_token.item() == pytest.approx(per_seq.item())
    assert m_tok["policy/clipfrac"].item() == m_seq["policy/clipfrac"].item()
    # k2 between the new and the old log-probabilities: 0.5 * (0.01 + 0.01 + 0.04) / 3
    assert m_seq["policy/approx_kl"].item() == pytest.approx(0.5 * 0.06 / 3)
