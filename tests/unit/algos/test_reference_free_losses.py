"""SimPO's and ORPO's pair losses against values and gradients computed by hand (the cross-check
against TRL's loss code is tests/unit/algos/test_preference_reference.py)."""

import math

import pytest
import torch

from rltrain.algos.orpo import log1mexp, orpo_log_odds_ratio, orpo_pair_losses
from rltrain.algos.simpo import simpo_pair_losses


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_simpo_value_and_gradient_by_hand():
    # mean log-probs: chosen -0.5, rejected -1.25; beta 2, gamma 1 -> z = 2 * 0.75 - 1 = 0.5
    chosen, rejected = torch.tensor([-0.5], requires_grad=True), torch.tensor([-1.25], requires_grad=True)
    loss = simpo_pair_losses(chosen, rejected, beta=2.0, gamma=1.0)
    assert loss.item() == pytest.approx(-math.log(sig(0.5)), rel=1e-6)
    loss.sum().backward()
    # d/dc -log s(z) = -(1 - s(z)) * beta
    assert chosen.grad.item() == pytest.approx(-(1 - sig(0.5)) * 2.0, rel=1e-6)
    assert rejected.grad.item() == pytest.approx((1 - sig(0.5)) * 2.0, rel=1e-6)


def test_simpo_margin_makes_equal_scores_lose():
    equal = torch.tensor([-1.0])
    assert simpo_pair_losses(equal, equal, 2.0, 0.0).item() == pytest.approx(math.log(2))
    assert simpo_pair_losses(equal, equal, 2.0, 1.0).item() == pytest.approx(-math.log(sig(-1.0)))


def test_log1mexp_on_both_branches():
    """Exact in the middle, and where log(1 - exp(x)) written naively loses every digit: near 0
    (1 - exp(x) ~ -x) and far below (log(1 - e) ~ -e)."""
    middle = torch.tensor([-0.1, -0.6931, -0.7, -5.0], dtype=torch.float64)
    want = torch.tensor([math.log(1 - math.exp(v)) for v in middle.tolist()], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(middle), want, rtol=1e-12, atol=0)
    near_zero, far = torch.tensor([-1e-10], dtype=torch.float64), torch.tensor([-40.0], dtype=torch.float64)
    assert log1mexp(near_zero).item() == pytest.approx(math.log(1e-10), rel=1e-9)
    assert log1mexp(far).item() == pytest.approx(-math.exp(-40.0), rel=1e-12)


def test_orpo_value_and_gradient_by_hand():
    # p_c = exp(-0.5), p_r = exp(-1.25); odds = p / (1 - p)
    c, r = -0.5, -1.25
    pc, pr = math.exp(c), math.exp(r)
    log_or = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
    chosen, rejected = torch.tensor([c], requires_grad=True), torch.tensor([r], requires_grad=True)
    assert orpo_log_odds_ratio(chosen, rejected).item() == pytest.approx(log_or, rel=1e-6)
    loss = orpo_pair_losses(chosen, rejected)
    assert loss.item() == pytest.approx(-math.log(sig(log_or)), rel=1e-6)
    loss.sum().backward()
    # d log_odds(m) / dm = 1 + p / (1 - p) = 1 / (1 - p); d loss = -(1 - s(log_or)) d log_or
    assert chosen.grad.item() == pytest.approx(-(1 - sig(log_or)) / (1 - pc), rel=1e-5)
    assert rejected.grad.item() == pytest.approx((1 - sig(log_or)) / (1 - pr), rel=1e-5)
