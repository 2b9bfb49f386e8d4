"""KTO's loss, reference point and mismatched pairs against values and gradients computed by hand
(the cross-check against TRL's loss code is tests/unit/algos/test_kto_reference.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rltrain.algos.kto import kto_losses, kto_micro_batches, kto_reference_kl, make_kto_loss, mismatched
from rltrain.data.ragged import Ragged
from rltrain.data.unpaired_data import LabelledCompletion, held_out_pairs


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_kto_values_and_gradients_by_hand():
    # log-ratios r = [-1 - -1.5, -2 - -1] = [0.5, -1.0]; z0 = 0.2; beta 0.5
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    losses = kto_losses(policy, ref, torch.tensor([True, False]), 0.2, beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    x, y = 0.5 * (0.5 - 0.2), 0.5 * (0.2 - -1.0)  # desirable: s(beta (r - z0)); undesirable: s(beta (z0 - r))
    assert losses.tolist() == pytest.approx([1 - sig(x), 1.5 * (1 - sig(y))], rel=1e-6)
    losses.sum().backward()
    # d/dp (1 - s(beta (p - ref - z0))) = -beta s'(x); d/dp w (1 - s(beta (z0 - p + ref))) = w beta s'(y)
    want = [-0.5 * sig(x) * (1 - sig(x)), 1.5 * 0.5 * sig(y) * (1 - sig(y))]
    assert policy.grad.tolist() == pytest.approx(want, rel=1e-5)


def test_the_first_step_loses_half_of_each_weight():
    """Policy == reference and z0 = 0: every example loses w * (1 - s(0)) = w / 2."""
    logps = torch.tensor([-3.0, -2.0, -5.0])
    losses = kto_losses(logps, logps, torch.tensor([True, False, False]), 0.0, 0.1, 1.0, 1.33)
    assert losses.tolist() == pytest.approx([0.5, 0.665, 0.665], rel=1e-6)


def test_the_reference_point_is_the_clamped_mean_log_ratio_without_gradient():
    policy = torch.tensor([-3.0, -2.0, -4.0], requires_grad=True)
    kl = kto_reference_kl(policy, torch.tensor([-3.5, -2.5, -4.3]))
    assert kl.item() == pytest.approx((0.5 + 0.5 + 0.3) / 3, rel=1e-6) and not kl.requires_grad
    assert kto_reference_kl(policy, torch.tensor([-1.0, -1.0, -1.0])).item() == 0.0  # mean -2: clamped
    # z0 passed with a graph still gives no gradient through it
    z0 = torch.tensor(0.3, requires_grad=True)
    policy_one = torch.tensor([-1.0], requires_grad=True)
    kto_losses(policy_one, torch.tensor([-1.0]), torch.tensor([True]), z0, 1.0).sum().backward()
    assert z0.grad is None and policy_one.grad is not None


def test_mismatched_pairs_give_each_prompt_the_previous_completion():
    """As TRL's KTOTrainer builds them: completion i-1 for prompt i, the last one's for the first,
    cut to data.max_length."""
    ex = [LabelledCompletion([1, 2], [3], True), LabelledCompletion([4], [5, 6, 7], False), LabelledCompletion([8], [9], True)]
    pairs = mismatched(ex, max_length=3)
    assert [(p.prompt, p.completion) for p in pairs] == [([1, 2], [9]), ([4], [3]), ([8], [5, 6])]


def test_the_loss_is_normalised_by_the_global_batch():
    """Split over micro-batches and ranks, the parts of the loss and of each metric sum to the
    whole batch's (each token's log-probability a function of the token, so layouts agree)."""
    ex = [LabelledCompletion([1, 2], [3, 4], True), LabelledCompletion([5], [6], False),
          LabelledCompletion([7], [8, 9, 10], False), LabelledCompletion([1], [2], True)]
    loss_fn = make_kto_loss(0.3, 1.0, 1.2)

    def run(world: int, micro: int) -> tuple[float, float]:
        loss_sum, reward_sum = 0.0, 0.0
        for rank in range(world):
            for mb in kto_micro_batches(ex, rank, world, micro, 0, 0.1):
                completions = [mb.tokens.values[o + p : e] for o, p, e in zip(
                    mb.tokens.offsets[:-1].tolist(), mb.prompt_lens.tolist(), mb.tokens.offsets[1:].tolist())]
                logps = Ragged.from_list([-0.1 * c.float() for c in completions])
                mb.extras["ref_logps"] = torch.full((len(mb),), -0.5)
                loss, metrics = loss_fn(SimpleNamespace(policy_logps=lambda logps=logps: logps), mb)
                loss_sum += float(loss)
                reward_sum += float(metrics["kto/rewards_rejected"])
        return loss_sum, reward_sum

    whole = run(1, 4)
    logratios = [-0.1 * 7 + 0.5, -0.1 * 6 + 0.5, -0.1 * 27 + 0.5, -0.1 * 2 + 0.5]
    want = [1 - sig(0.3 * (logratios[0] - 0.1)), 1.2 * (1 - sig(0.3 * (0.1 - logratios[1]))),
            1.2 * (1 - sig(0.3 * (0.1 - logratios[2]))), 1 - sig(0.3 * (logratios[3] - 0.1))]
    assert whole[0] == pytest.approx(sum(want) / 4, rel=1e-6)
    assert whole[1] == pytest.approx(0.3 * (logratios[1] + logratios[2]) / 2, rel=1e-6)
    assert run(2, 1) == pytest.approx(whole, rel=1e-6)


def test_held_out_pairs_match_desirable_and_undesirable_of_one_prompt():
    ex = [LabelledCompletion([1], [2], True), LabelledCompletion([1], [3], False), LabelledCompletion([4], [5], True),
          LabelledCompletion([1], [6], True), LabelledCompletion([4], [5], False)]
    pairs = held_out_pairs(ex)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [([1], [2], [3])]  # [4]: same text both ways
