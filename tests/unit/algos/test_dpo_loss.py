import math

import pytest
import torch

from rltrain.algos.dpo import dpo_pair_losses
from rltrain.algos.preference import implicit_rewards


def _h():
    # policy chosen/rejected, reference chosen/rejected -> h = (-1 - -2) - (-3 - -2.5) = 1.5
    return torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5])


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_sigmoid_matches_hand_value():
    beta = 0.5
    expected = -math.log(sig(0.75))
    assert dpo_pair_losses(*_h(), beta, "sigmoid").item() == pytest.approx(expected, rel=1e-6)


def test_sigmoid_label_smoothing_is_conservative_dpo():
    beta, eps = 0.5, 0.1
    expected = -(1 - eps) * math.log(sig(0.75)) - eps * math.log(sig(-0.75))
    assert dpo_pair_losses(*_h(), beta, "sigmoid", eps).item() == pytest.approx(expected, rel=1e-6)


def test_robust_matches_hand_value():
    beta, eps = 0.5, 0.1
    expected = (-(1 - eps) * math.log(sig(0.75)) + eps * math.log(sig(-0.75))) / (1 - 2 * eps)
    assert dpo_pair_losses(*_h(), beta, "robust", eps).item() == pytest.approx(expected, rel=1e-6)


def test_hinge_matches_hand_value():
    assert dpo_pair_losses(*_h(), 0.5, "hinge").item() == pytest.approx(0.25)
    assert dpo_pair_losses(*_h(), 1.0, "hinge").item() == 0.0


def test_ipo_matches_hand_value():
    one = torch.tensor([1.0])
    beta = 0.5  # one-token completions: (1.5 - 1/(2*0.5))^2 = 0.25
    assert dpo_pair_losses(*_h(), beta, "ipo", 0.0, one, one).item() == pytest.approx(0.25)
    # per-token log-ratios: chosen (-1 - -2) / 2 = 0.5, rejected (-3 - -2.5) / 4 = -0.125 -> (0.625 - 1)^2
    got = dpo_pair_losses(*_h(), beta, "ipo", 0.0, torch.tensor([2.0]), torch.tensor([4.0])).item()
    assert got == pytest.approx(0.140625)
    with pytest.raises(ValueError, match="lengths"):
        dpo_pair_losses(*_h(), beta, "ipo")


def test_implicit_rewards_and_unknown_type():
    assert implicit_rewards(torch.tensor([-1.0]), torch.tensor([-2.0]), 0.1).item() == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"algo\.loss='nope'"):
        dpo_pair_losses(*_h(), 0.1, "nope")
