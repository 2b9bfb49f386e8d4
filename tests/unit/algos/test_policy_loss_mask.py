"""Multi-turn episodes interleave the environment's observations with the model's tokens; the
policy loss, the rollout correction and their metrics with `sampled` must equal the same functions
on the sampled tokens alone (observations get no gradient and count in no mean)."""

from __future__ import annotations

import pytest
import torch

from rltrain.algos.policy_loss import PolicyLossInputs, policy_loss
from rltrain.algos.rollout_correction import correction, correction_metrics
from rltrain.data.ragged import Ragged

# Two episodes: sampled, sampled, observation, observation, sampled | sampled, observation, sampled
MASK = [[True, True, False, False, True], [True, False, True]]


def ragged(rows) -> Ragged:
    return Ragged.from_list([torch.tensor(r) for r in rows])


def only_sampled(rows):
    return [[v for v, keep in zip(r, m, strict=True) if keep] for r, m in zip(rows, MASK, strict=True)]


LOGPS = [[-0.5, -1.0, -3.0, -4.0, -0.2], [-0.7, -2.5, -0.9]]
OLD = [[-0.6, -0.9, -9.0, -9.0, -0.3], [-0.5, -9.0, -1.0]]
REF = [[-0.4, -1.2, -1.0, -1.0, -0.1], [-0.9, -1.0, -0.8]]
ENGINE = [[-0.65, -0.95, 0.0, 0.0, -0.25], [-0.45, 0.0, -1.3]]  # 0 on observations, as episodes record them
ADV_B = torch.tensor([1.0, -2.0])


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_the_masked_loss_and_its_gradient_equal_the_loss_on_the_sampled_tokens(loss_agg):
    full = torch.tensor([v for r in LOGPS for v in r], requires_grad=True)
    part = torch.tensor([v for r in only_sampled(LOGPS) for v in r], requires_grad=True)
    common = dict(clip_low=0.2, clip_high=0.28, beta=0.1, loss_agg=loss_agg, global_tokens=5.0, global_seqs=2.0, max_len=8)
    loss_full, m_full = policy_loss(PolicyLossInputs(
        ragged(LOGPS).with_values(full), ADV_B, old_logps=ragged(OLD), ref_logps=ragged(REF), entropy=ragged(LOGPS),
        sampled=ragged(MASK), **common,
    ))
    loss_part, m_part = policy_loss(PolicyLossInputs(
        ragged(only_sampled(LOGPS)).with_values(part), ADV_B, old_logps=ragged(only_sampled(OLD)),
        ref_logps=ragged(only_sampled(REF)), entropy=ragged(only_sampled(LOGPS)), **common,
    ))
    assert loss_full.item() == pytest.approx(loss_part.item(), rel=1e-6)
    for key in m_part:
        assert m_full[key].item() == pytest.approx(m_part[key].item(), rel=1e-6, abs=1e-9), key
    loss_full.backward()
    loss_part.backward()
    flags = torch.tensor([f for r in MASK for f in r])
    assert torch.equal(full.grad[~flags], torch.zeros(3))
    torch.testing.assert_close(full.grad[flags], part.grad)


def test_on_policy_token_mean_by_hand():
    """ratio 1: the loss is -(sum of each sampled token's advantage) / sampled tokens =
    -(3 * 1 + 2 * (-2)) / 5 = 0.2; over every token it would be -(5 * 1 + 3 * (-2)) / 8 = 0.125."""
    logps = ragged(LOGPS)
    loss, _ = policy_loss(PolicyLossInputs(logps, ADV_B, sampled=ragged(MASK), global_tokens=5.0, global_seqs=2.0))
    assert loss.item() == pytest.approx(0.2)


@pytest.mark.parametrize("mode", ["tis", "mask"])
def test_the_rollout_correction_reads_the_sampled_tokens_only(mode):
    w_full, keep_full = correction(ragged(OLD), ragged(ENGINE), mode, 2.0, 1.08, sampled=ragged(MASK))
    w_part, keep_part = correction(ragged(only_sampled(OLD)), ragged(only_sampled(ENGINE)), mode, 2.0, 1.08)
    if mode == "tis":
        assert w_full is not None and w_part is not None
        flags = torch.tensor([f for r in MASK for f in r])
        torch.testing.assert_close(w_full.values[flags], w_part.values)
        assert torch.equal(w_full.values[~flags], torch.ones(3))  # an observation's weight is 1
        got = correction_metrics(w_full, None, 5, 5.0, 2.0, sampled=ragged(MASK))
        want = correction_metrics(w_part, None, 5, 5.0, 2.0)
        assert float(got["rollout/is_weight_mean"]) == pytest.approx(float(want["rollout/is_weight_mean"]))
    else:
        assert keep_full is not None and keep_part is not None
        assert torch.equal(keep_full, keep_part) and keep_full.tolist() == [True, False]
