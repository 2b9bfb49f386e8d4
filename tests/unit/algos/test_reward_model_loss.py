"""The reward model's Bradley-Terry loss (algo=rm): values and gradients by hand, the loss closure
on a ragged batch (each completion's reward is its last value), and TRL 1.16's
`RewardTrainer.compute_loss` driven through a stub model on random ragged batches, equal to fp32
rounding (TRL is pinned with the test tools, requirements/).
"""

from __future__ import annotations

import importlib
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rltrain.algos.rm import last_token_rewards, make_reward_model_loss, reward_pair_losses
from rltrain.data.ragged import Ragged


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_bradley_terry_value_and_gradient_by_hand():
    # r_c 1.5, r_r 0.25, margin 0.5 -> z = 0.75; loss -log s(0.75); d/dr_c = -(1 - s(z)) = -d/dr_r
    chosen, rejected = torch.tensor([1.5], requires_grad=True), torch.tensor([0.25], requires_grad=True)
    loss = reward_pair_losses(chosen, rejected, torch.tensor([0.5]))
    assert loss.item() == pytest.approx(-math.log(sig(0.75)), rel=1e-6)
    loss.sum().backward()
    assert chosen.grad.item() == pytest.approx(-(1 - sig(0.75)), rel=1e-6)
    assert rejected.grad.item() == pytest.approx(1 - sig(0.75), rel=1e-6)


def test_centering_term_by_hand():
    # + c (r_c + r_r)^2 with c 0.1: 0.1 * 1.75^2; its gradient 2 c (r_c + r_r) = 0.35 on both
    chosen, rejected = torch.tensor([1.5], requires_grad=True), torch.tensor([0.25], requires_grad=True)
    loss = reward_pair_losses(chosen, rejected, None, center_coefficient=0.1)
    assert loss.item() == pytest.approx(-math.log(sig(1.25)) + 0.1 * 1.75**2, rel=1e-6)
    loss.sum().backward()
    assert chosen.grad.item() == pytest.approx(-(1 - sig(1.25)) + 0.35, rel=1e-6)
    assert rejected.grad.item() == pytest.approx((1 - sig(1.25)) + 0.35, rel=1e-6)


def test_equal_rewards_cost_log_two_and_a_margin_more():
    equal = torch.tensor([0.3])
    assert reward_pair_losses(equal, equal).item() == pytest.approx(math.log(2))
    assert reward_pair_losses(equal, equal, torch.tensor([1.0])).item() == pytest.approx(-math.log(sig(-1.0)))


def test_reward_is_the_last_value_of_each_completion():
    values = Ragged.from_lengths(torch.tensor([0.1, 0.2, 0.9, 5.0, -1.0, 7.0, 0.0, 3.0]), [3, 1, 2, 2])
    chosen_P, rejected_P = last_token_rewards(values)
    assert chosen_P.tolist() == pytest.approx([0.9, 7.0]) and rejected_P.tolist() == pytest.approx([5.0, 3.0])


def test_loss_closure_divides_by_the_global_pair_count():
    values = Ragged.from_lengths(torch.tensor([0.0, 2.0, 1.0, 0.0, 0.5]), [2, 1, 1, 1])
    output = SimpleNamespace(values=values)
    loss, metrics = make_reward_model_loss(0.0)(output, SimpleNamespace(extras={"global_pairs": 4.0}))
    # pairs (2.0 vs 1.0) and (0.0 vs 0.5), over 4 pairs in the whole step
    assert loss.item() == pytest.approx((-math.log(sig(1.0)) - math.log(sig(-0.5))) / 4, rel=1e-6)
    assert metrics["rm/accuracy"].item() == pytest.approx(0.25)
    assert metrics["rm/margin"].item() == pytest.approx((1.0 - 0.5) / 4)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("center", [None, 0.01])
@pytest.mark.parametrize("with_margin", [False, True])
def test_against_trl_reward_trainer(seed, center, with_margin):
    """TRL's `RewardTrainer.compute_loss` on a stub whose model returns the rewards as logits,
    chosen rows first; rltrain's closure on the interleaved ragged values whose last entries they are."""
    reward_trainer = importlib.import_module("trl.trainer.reward_trainer")
    g = torch.Generator().manual_seed(seed)
    pairs = 6
    lengths_S = torch.randint(1, 9, (2 * pairs,), generator=g)
    values_N = torch.randn(int(lengths_S.sum()), generator=g, dtype=torch.float32)
    margins_P = torch.rand(pairs, generator=g) if with_margin else None

    values = Ragged.from_lengths(values_N.clone().requires_grad_(True), lengths_S)
    extras = {"global_pairs": float(pairs)}
    if margins_P is not None:
        extras["margins"] = margins_P
    ours, metrics = make_reward_model_loss(center or 0.0)(SimpleNamespace(values=values), SimpleNamespace(extras=extras))
    ours.backward()

    last_S = (values_N[lengths_S.cumsum(0) - 1]).clone()
    logits = torch.cat([last_S[0::2], last_S[1::2]])[:, None].requires_grad_(True)
    inputs = {"input_ids": torch.zeros(2 * pairs, 3, dtype=torch.long), "attention_mask": torch.ones(2 * pairs, 3, dtype=torch.long)}
    if margins_P is not None:
        inputs["margin"] = margins_P
    accelerator = SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t)
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), args=SimpleNamespace(center_rewards_coefficient=center),
        accelerator=accelerator, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    theirs = reward_trainer.RewardTrainer.compute_loss(stub, lambda **_: SimpleNamespace(logits=logits), inputs)
    theirs.backward()

    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    # their gradient of each reward, at the completion's last token in ours (zero elsewhere)
    grads_S = torch.cat([logits.grad[:pairs, 0], logits.grad[pairs:, 0]]).view(2, pairs).t().reshape(-1)
    want_N = torch.zeros_like(values_N)
    want_N[lengths_S.cumsum(0) - 1] = grads_S
    torch.testing.assert_close(values.values.grad, want_N, rtol=1e-6, atol=1e-7)
    assert metrics["rm/accuracy"].item() == pytest.approx(stub._metrics["train"]["accuracy"][0])
    assert metrics["rm/margin"].item() == pytest.approx(stub._metrics["train"]["margin"][0], rel=1e-5)
