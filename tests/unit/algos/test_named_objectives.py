"""The objectives users ask for by name, by hand on a small ragged batch (values and gradients):
GSPO (`importance_level=sequence`), CISPO (`policy_loss=cispo`), Dr. GRPO's aggregation and DAPO's
soft overlong punishment. tests/unit/algos/test_objectives_reference.py checks the same functions
against each paper's formula written independently and against TRL's loss code.
"""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algos.policy_loss import PolicyLossInputs, policy_loss
from rltrain.data.ragged import Ragged
from rltrain.rewards.overlong import overlong_penalties

# Two completions of 2 and 1 tokens. Log ratios log(pi / pi_old): [0.2, -0.4] and [0.5].
LOGPS = [[-1.0, -2.0], [-0.5]]
OLD = [[-1.2, -1.6], [-1.0]]


def _ragged(rows, requires_grad: bool = False) -> Ragged:
    r = Ragged.from_list([torch.tensor(row, dtype=torch.float32) for row in rows])
    return r.with_values(r.values.clone().requires_grad_(requires_grad))


def _loss(adv, **kwargs):
    logps = _ragged(LOGPS, requires_grad=True)
    loss, metrics = policy_loss(PolicyLossInputs(
        logps, torch.tensor(adv), old_logps=_ragged(OLD), global_tokens=3.0, global_seqs=2.0, **kwargs
    ))
    loss.backward()
    return loss.item(), logps.values.grad.tolist(), metrics


def test_gspo_clips_the_length_normalised_sequence_ratio():
    """s_0 = exp((0.2 - 0.4) / 2) = exp(-0.1), inside [0.8, 1.28]: its tokens share -A s_0 / 2 of the
    gradient each (then / 2 sequences). s_1 = exp(0.5) = 1.6487 > 1.28 with A = +1: clipped, no gradient.
    Loss (seq_mean_token_mean) = (-s_0 - 1.28) / 2."""
    s0 = math.exp(-0.1)
    loss, grad, metrics = _loss([1.0, 1.0], importance_level="sequence", loss_agg="seq_mean_token_mean")
    assert loss == pytest.approx((-s0 - 1.28) / 2, rel=1e-6)
    assert grad == pytest.approx([-s0 / 4, -s0 / 4, 0.0], rel=1e-6)
    assert metrics["policy/clipfrac"].item() == pytest.approx(1 / 3)  # the one token of the clipped sequence


def test_gspo_with_a_negative_advantage_keeps_the_unclipped_branch():
    """A = -1 on sequence 1: -A s_1 = 1.6487 > -A * 1.28, so the unclipped term wins and keeps its
    gradient s_1 / 2 (one token, / 2 sequences); sequence 0 (A = +1) as above."""
    s0, s1 = math.exp(-0.1), math.exp(0.5)
    loss, grad, _ = _loss([1.0, -1.0], importance_level="sequence", loss_agg="seq_mean_token_mean")
    assert loss == pytest.approx((-s0 + s1) / 2, rel=1e-6)
    assert grad == pytest.approx([-s0 / 4, -s0 / 4, s1 / 2], rel=1e-6)


def test_the_token_level_ratio_is_unchanged_by_the_new_keys():
    """`importance_level=token`, `policy_loss=clip` is the loss as before: per-token ratios
    [e^0.2, e^-0.4, e^0.5], A = +1, token_mean over 3 tokens; e^0.5 is clipped at 1.28 (no gradient),
    e^-0.4 = 0.67 < 0.8 is not clipped for a positive advantage (the min keeps the unclipped term)."""
    r = [math.exp(0.2), math.exp(-0.4), math.exp(0.5)]
    loss, grad, _ = _loss([1.0, 1.0])
    assert loss == pytest.approx(-(r[0] + r[1] + 1.28) / 3, rel=1e-6)
    assert grad == pytest.approx([-r[0] / 3, -r[1] / 3, 0.0], rel=1e-6)


def test_cispo_clips_a_detached_weight_and_every_token_keeps_a_gradient():
    """CISPO: loss_t = -A sg(min(r_t, 1 + clip_high)) logp_t. Weights [e^0.2, e^-0.4, 1.28] (the last
    capped); the gradient of token t is -A w_t / 3 (token_mean), the capped token's too."""
    w = [math.exp(0.2), math.exp(-0.4), 1.28]
    flat_logps = [v for row in LOGPS for v in row]
    loss, grad, metrics = _loss([1.0, -1.0], kind="cispo")
    adv = [1.0, 1.0, -1.0]
    assert loss == pytest.approx(sum(-a * wt * lp for a, wt, lp in zip(adv, w, flat_logps, strict=True)) / 3, rel=1e-6)
    assert grad == pytest.approx([-a * wt / 3 for a, wt in zip(adv, w, strict=True)], rel=1e-6)
    assert all(g != 0.0 for g in grad)
    assert metrics["policy/clipfrac"].item() == pytest.approx(1 / 3)


def test_dr_grpo_sums_each_sequence_over_the_generation_budget():
    """On-policy (ratio 1) with loss_agg=seq_mean_token_sum_norm and max_len 4: the loss is
    -(2 * A_0 + 1 * A_1) / (4 * 2) and each token's gradient -A / 8, whatever its sequence's length."""
    logps = _ragged(LOGPS, requires_grad=True)
    loss, _ = policy_loss(PolicyLossInputs(
        logps, torch.tensor([1.0, -3.0]), loss_agg="seq_mean_token_sum_norm", max_len=4, global_tokens=3.0, global_seqs=2.0
    ))
    loss.backward()
    assert loss.item() == pytest.approx(-(2 * 1.0 + 1 * -3.0) / 8)
    assert logps.values.grad.tolist() == pytest.approx([-1 / 8, -1 / 8, 3 / 8])


def test_unknown_objective_names_are_errors_naming_the_key():
    with pytest.raises(ValueError, match="algo.importance_level='seq'"):
        _loss([1.0, 1.0], importance_level="seq")
    with pytest.raises(ValueError, match="algo.policy_loss='gpo'"):
        _loss([1.0, 1.0], kind="gpo")


def test_overlong_penalty_by_hand():
    """Budget 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at the budget and beyond."""
    assert overlong_penalties([5, 6, 7, 9, 10, 12], 10, 4, 1.0) == pytest.approx([0, 0, -0.25, -0.75, -1.0, -1.0])
    assert overlong_penalties([10], 10, 4, 0.5) == [-0.5]
    assert overlong_penalties([10, 3], 10, 0, 1.0) == [0.0, 0.0]  # buffer 0: off


def test_distillation_advantage_is_the_teachers_log_probability_less_the_students():
    """Per token: log p_teacher - log p_student; its negated mean is the reverse KL estimate."""
    from rltrain.algos.advantages import reverse_kl_advantages

    student, teacher = _ragged([[-1.0, -2.0], [-0.5]]), _ragged([[-1.5, -1.0], [-0.5]])
    adv = reverse_kl_advantages(student, teacher)
    assert adv.values.tolist() == pytest.approx([-0.5, 1.0, 0.0])
    assert adv.lengths().tolist() == [2, 1]
    with pytest.raises(ValueError, match="teacher log-probabilities for 1 sequences"):
        reverse_kl_advantages(student, _ragged([[-1.0]]))


def test_distillations_gradient_is_the_reverse_kls_on_policy():
    """On-policy (ratio 1) with token_mean, the policy loss on these advantages is the score-function
    estimate of the reverse KL's gradient: d/d logp_t = -A_t / N = (log p_student_t - log p_teacher_t) / N."""
    from rltrain.algos.advantages import reverse_kl_advantages

    student_rows, teacher_rows = [[-1.0, -2.0], [-0.5]], [[-1.5, -1.0], [-0.3]]
    logps = _ragged(student_rows, requires_grad=True)
    adv = reverse_kl_advantages(logps.with_values(logps.values.detach()), _ragged(teacher_rows))
    loss, _ = policy_loss(PolicyLossInputs(logps, adv, global_tokens=3.0, global_seqs=2.0))
    loss.backward()
    flat_s = [v for r in student_rows for v in r]
    flat_t = [v for r in teacher_rows for v in r]
    assert logps.values.grad.tolist() == pytest.approx([(s - t) / 3 for s, t in zip(flat_s, flat_t, strict=True)])
