"""`+experiment=gspo` is GSPO as its paper defines it (Zheng et al. 2025, eq. 5-7): the composed
config asks for the sequence ratio *and* the mean over sequences, and the loss the run's config
builds (rltrain.algos.rl.update.make_policy_loss) is the paper's objective, value and gradient,
written here at the sequence level. The recipe's run on CPU: tests/e2e/test_recipes.py."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import compose_config

from rltrain.algos.rl.update import PolicyBatchInputs, make_policy_loss
from rltrain.backends.base import PolicyOutput
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged

# Two completions of 3 and 1 tokens. Sequence 0's log ratios average 1e-4 (inside the paper's clip
# band [1 - 3e-4, 1 + 4e-4]); sequence 1's is 0.01 (outside: clipped for its positive advantage).
OLD = [[-1.0, -2.0, -0.5], [-1.5]]
LOG_RATIOS = [[1e-4, -2e-4, 4e-4], [0.01]]
ADV = [0.5, 1.0]


@pytest.fixture(scope="module")
def gspo_algo():
    return compose_config("+experiment=gspo").algo


def test_the_recipe_composes_the_sequence_ratio_and_the_sequence_mean(gspo_algo):
    assert gspo_algo.name == "grpo" and gspo_algo.policy_loss == "gspo"  # the surrogate table's sequence-ratio entry
    assert gspo_algo.importance_level == "token"  # the kind alone puts the clip on the sequence ratio
    assert gspo_algo.loss_agg == "seq_mean_token_mean"
    assert (gspo_algo.clip_low, gspo_algo.clip_high) == (3e-4, 4e-4)


def _recipe_loss(algo, logps_N: torch.Tensor) -> torch.Tensor:
    lengths = [len(row) for row in OLD]
    batch = SequenceBatch.from_lists([[1, 2], [3]], [[4, 5, 6], [7]])
    old = Ragged.from_lengths(torch.tensor([v for row in OLD for v in row]), lengths)
    batch.loss_inputs = PolicyBatchInputs(
        adv=torch.tensor(ADV), engine_logps=old, old_logps=old, global_tokens=4.0, global_seqs=2.0
    )
    loss, _ = make_policy_loss(algo)(PolicyOutput(Ragged.from_lengths(logps_N, lengths)), batch)
    return loss


def _papers_objective(logps_N: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """-J_GSPO = -(1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i), with
    s_i = exp((1/|y_i|) sum_t log(pi / pi_old)), written per sequence."""
    terms, start = [], 0
    for row, adv in zip(OLD, ADV):
        s = torch.exp((logps_N[start : start + len(row)] - torch.tensor(row)).mean())
        terms.append(torch.minimum(s * adv, torch.clamp(s, 1 - clip_low, 1 + clip_high) * adv))
        start += len(row)
    return -torch.stack(terms).mean()


def test_the_recipes_loss_is_the_papers_objective(gspo_algo):
    base = torch.tensor([o + r for row_o, row_r in zip(OLD, LOG_RATIOS) for o, r in zip(row_o, row_r)])
    ours_N, paper_N = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss = _recipe_loss(gspo_algo, ours_N)
    expected = _papers_objective(paper_N, gspo_algo.clip_low, gspo_algo.clip_high)
    s0 = math.exp(sum(LOG_RATIOS[0]) / 3)
    assert loss.item() == pytest.approx(-(0.5 * s0 + 1.0 * (1 + 4e-4)) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    expected.backward()
    assert ours_N.grad.tolist() == pytest.approx(paper_N.grad.tolist(), rel=1e-5)
    assert ours_N.grad[3].item() == 0.0  # the clipped sequence
    # Each of sequence 0's three tokens gets a third of its sequence's gradient: with the token mean
    # (importance_level=sequence alone) they would get a quarter each, the long completion weighing 3x.
    assert ours_N.grad[:3].tolist() == pytest.approx([-0.5 * s0 / 3 / 2] * 3, rel=1e-5)


def test_the_gspo_kind_is_the_clip_on_the_sequence_ratio_bitwise(gspo_algo):
    """`algo.policy_loss=gspo` and `algo.policy_loss=clip algo.importance_level=sequence` are one
    objective: the same loss and gradient to the bit."""
    from omegaconf import OmegaConf

    logps_N = torch.tensor([v + d for row, deltas in zip(OLD, LOG_RATIOS) for v, d in zip(row, deltas)])
    grads = []
    for algo in (gspo_algo, OmegaConf.merge(gspo_algo, {"policy_loss": "clip", "importance_level": "sequence"})):
        x = logps_N.clone().requires_grad_()
        loss = _recipe_loss(algo, x)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
