"""Rollout correction weights and masks against values computed by hand, and their effect on the
policy loss (rltrain/algos/rollout_correction.py, rltrain/algos/policy_loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algos.policy_loss import PolicyLossInputs, policy_loss
from rltrain.algos.rollout_correction import correction, correction_metrics, resolve_mode
from rltrain.data.ragged import Ragged


def _ragged(values, lengths):
    return Ragged.from_lengths(torch.tensor(values, dtype=torch.float32), lengths)


OLD = _ragged([-1.0, -2.0, -0.5, -3.0], [2, 2])
ENGINE = _ragged([-1.5, -1.0, -0.5, -0.2], [2, 2])  # old - engine = [0.5, -1.0, 0.0, -2.8]


def test_none_is_no_correction():
    assert correction(OLD, ENGINE, "none", 2.0, 2.0) == (None, None)


def test_tis_weights_are_truncated_ratios():
    weights, keep = correction(OLD, ENGINE, "tis", 1.5, 2.0)
    assert keep is None
    assert weights.values.tolist() == pytest.approx([1.5, math.exp(-1.0), 1.0, math.exp(-2.8)])  # e^0.5 = 1.65 -> 1.5
    m = correction_metrics(weights, None, 4, global_tokens=8.0, global_seqs=4.0)
    assert float(m["rollout/is_weight_mean"]) == pytest.approx((1.5 + math.exp(-1.0) + 1.0 + math.exp(-2.8)) / 8)
    assert float(m["rollout/masked_frac"]) == 0.0


def test_mask_drops_sequences_whose_geometric_ratio_leaves_the_band():
    # mean log-ratio: seq 0 = -0.25 (ratio 0.78, kept), seq 1 = -1.4 (ratio 0.25, dropped at band 2)
    weights, keep = correction(OLD, ENGINE, "mask", 2.0, 2.0)
    assert weights is None and keep.tolist() == [True, False]
    _, keep_wide = correction(OLD, ENGINE, "mask", 2.0, 5.0)
    assert keep_wide.tolist() == [True, True]
    m = correction_metrics(None, keep, 4, global_tokens=4.0, global_seqs=2.0)
    assert float(m["rollout/masked_frac"]) == 0.5 and float(m["rollout/is_weight_mean"]) == 1.0


def test_the_loss_applies_weights_per_token_and_masks_per_sequence():
    logps = Ragged.from_lengths(torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True), [2, 2])
    adv = torch.tensor([1.0, -1.0])
    kw = dict(global_tokens=4.0, global_seqs=2.0)
    plain, _ = policy_loss(PolicyLossInputs(logps, adv, **kw))  # ratio 1: pg = -A per token -> (-1 -1 +1 +1) / 4 = 0
    weights, _ = correction(OLD, ENGINE, "tis", 1.5, 2.0)
    weighted, _ = policy_loss(PolicyLossInputs(logps, adv, is_weights=weights, **kw))
    w = weights.values.tolist()
    assert plain.item() == pytest.approx(0.0)
    assert weighted.item() == pytest.approx((-w[0] - w[1] + w[2] + w[3]) / 4)
    masked, _ = policy_loss(PolicyLossInputs(logps, adv, keep_B=torch.tensor([True, False]), **kw))
    assert masked.item() == pytest.approx(-2.0 / 4)  # the dropped sequence still counts in the denominator


def test_unknown_mode_and_bad_bounds_are_errors():
    with pytest.raises(ValueError, match="rollout_correction"):
        correction(OLD, ENGINE, "is", 2.0, 2.0)
    with pytest.raises(ValueError, match="rollout_mask_band"):
        correction(OLD, ENGINE, "mask", 2.0, 0.5)


def test_auto_is_none_in_sync_and_tis_when_generating_ahead():
    assert resolve_mode("auto", 0) == "none"
    assert resolve_mode("auto", 1) == "tis" and resolve_mode("auto", 3) == "tis"
    assert resolve_mode("mask", 2) == "mask" and resolve_mode("none", 2) == "none"  # an explicit choice stands


def test_decoupled_loss_clips_against_the_proximal_policy_and_weights_the_behaviour_gap():
    """A batch sampled two versions ago: the behaviour log-probabilities (the engine's, stale), the
    proximal ones (the trainer's at its current weights, before this update's iterations) and the
    current ones differ. Values by hand, clip 0.2 / 0.28, cap 2, one sequence, advantage 1."""
    current = Ragged.from_lengths(torch.tensor([-0.5, -2.0], requires_grad=True), [2])
    proximal = _ragged([-1.2, -1.9], [2])
    behaviour = _ragged([-1.5, -1.0], [2])
    weights, keep = correction(proximal, behaviour, "tis", 2.0, 2.0)
    assert keep is None
    # exp(proximal - behaviour): exp(0.3), exp(-0.9); neither reaches the cap
    assert weights.values.tolist() == pytest.approx([math.exp(0.3), math.exp(-0.9)])
    loss, _ = policy_loss(PolicyLossInputs(current, torch.tensor([1.0]), old_logps=proximal, is_weights=weights,
                          clip_low=0.2, clip_high=0.28, global_tokens=2.0, global_seqs=1.0))
    # ratio to the proximal policy: exp(0.7) = 2.01 is clipped at 1.28; exp(-0.1) = 0.905 is inside.
    # (Against the behaviour policy the first ratio would be exp(1.0) and the second exp(-1.0).)
    expected = (-1.28 * math.exp(0.3) - math.exp(-0.1) * math.exp(-0.9)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # The clipped token gets no gradient; the other d/dlogp = -ratio * weight / 2.
    assert current.values.grad.tolist() == pytest.approx([0.0, -math.exp(-0.1) * math.exp(-0.9) / 2], rel=1e-6)


def test_in_sync_auto_leaves_the_loss_exactly_as_without_correction():
    logps = Ragged.from_lengths(torch.tensor([-1.0, -2.0, -0.5, -3.0]), [2, 2])
    weights, keep = correction(OLD, ENGINE, resolve_mode("auto", 0), 2.0, 2.0)
    assert (weights, keep) == (None, None)
    kw = dict(old_logps=OLD, global_tokens=4.0, global_seqs=2.0)
    a, _ = policy_loss(PolicyLossInputs(logps, torch.tensor([1.0, -1.0]), is_weights=weights, keep_B=keep, **kw))
    b, _ = policy_loss(PolicyLossInputs(logps, torch.tensor([1.0, -1.0]), **kw))
    assert a.item() == b.item()
