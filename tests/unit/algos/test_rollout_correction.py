"""Rollout correction weights and masks against values computed by hand, and their effect on the
policy loss (rltrain/algos/rollout_correction.py, rltrain/algos/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algos.losses import policy_loss
from rltrain.algos.rollout_correction import correction, correction_metrics
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
    plain, _ = policy_loss(logps, adv, **kw)  # ratio 1: pg = -A per token -> (-1 -1 +1 +1) / 4 = 0
    weights, _ = correction(OLD, ENGINE, "tis", 1.5, 2.0)
    weighted, _ = policy_loss(logps, adv, is_weights=weights, **kw)
    w = weights.values.tolist()
    assert plain.item() == pytest.approx(0.0)
    assert weighted.item() == pytest.approx((-w[0] - w[1] + w[2] + w[3]) / 4)
    masked, _ = policy_loss(logps, adv, keep_B=torch.tensor([True, False]), **kw)
    assert masked.item() == pytest.approx(-2.0 / 4)  # the dropped sequence still counts in the denominator


def test_unknown_mode_and_bad_bounds_are_errors():
    with pytest.raises(ValueError, match="rollout_correction"):
        correction(OLD, ENGINE, "is", 2.0, 2.0)
    with pytest.raises(ValueError, match="rollout_mask_band"):
        correction(OLD, ENGINE, "mask", 2.0, 0.5)
