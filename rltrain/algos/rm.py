"""Reward-model training: a Bradley-Terry model of preference pairs, saved for PPO and GRPO.

The model is the policy's with a bias-free scalar head for its LM head (a value engine). A
sequence's reward is the head on the state predicting its last completion token (the EOS), i.e.
the last text token's, where the sequence classifier in `final/` reads it when `reward_model=hf`
scores decoded text. Pairs and held-out accuracy: rltrain/algos/preference.py; docs/algorithms.md,
"Reward model".

    python -m rltrain algo=rm
"""

from __future__ import annotations

import torch

from rltrain.algos.losses import reward_pair_losses
from rltrain.algos.preference import PairwisePreference, score_pairs
from rltrain.backends.base import PolicyOutput
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged


def last_token_rewards(values: Ragged) -> tuple[torch.Tensor, torch.Tensor]:
    """([P], [P]) each chosen and rejected completion's reward: its last value (completions are
    never empty), of a `pairs_to_batch` batch."""
    last_S = values.values[values.offsets[1:].to(values.values.device) - 1]
    return last_S[0::2], last_S[1::2]


def scored_rewards(engine, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`score_pairs`'s scorer for a reward model: the rewards of a batch's pairs, no gradients."""
    (values,) = engine.forward_values([batch])
    if len(batch) == 0:
        return values.values[:0], values.values[:0]
    return last_token_rewards(values)


def reward_metrics(rewards_chosen_P: torch.Tensor, rewards_rejected_P: torch.Tensor, n_pairs: float) -> dict[str, torch.Tensor]:
    """This micro-batch's share of the `rm/*` metrics (means over the step's pairs)."""
    rew_c, rew_r = rewards_chosen_P.detach().float(), rewards_rejected_P.detach().float()
    return {
        "rm/accuracy": (rew_c > rew_r).double().sum() / n_pairs,
        "rm/margin": (rew_c - rew_r).sum() / n_pairs,
        "rm/rewards_chosen": rew_c.sum() / n_pairs,
        "rm/rewards_rejected": rew_r.sum() / n_pairs,
    }


def make_reward_model_loss(center_rewards_coefficient: float):
    def reward_model_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert output.values is not None, "algo=rm trains a value model"
        n_pairs = batch.extras["global_pairs"]
        rew_c, rew_r = last_token_rewards(output.values)
        margins_P = batch.extras.get("margins")
        loss = reward_pair_losses(rew_c, rew_r, margins_P, center_rewards_coefficient).sum() / n_pairs
        return loss, reward_metrics(rew_c, rew_r, n_pairs)

    return reward_model_loss


class RewardModel(PairwisePreference):
    eval_key = "eval/rm_accuracy"
    samples_greedy = False  # a reward model generates nothing

    def __init__(self, ctx) -> None:
        self.loss_fn = make_reward_model_loss(ctx.cfg.algo.center_rewards_coefficient)
        super().__init__(ctx)

    def attach_inputs(self, micro: list[SequenceBatch], micro_idx: list[list[int]], index: list[int]) -> None:
        for mb, idx in zip(micro, micro_idx):
            margins = [self.data.train[index[i]].margin for i in idx]
            if any(margins):
                mb.extras["margins"] = torch.tensor(margins, dtype=torch.float32, device="cpu")

    def eval_scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        return score_pairs(self.policy, self.data.eval, score=scored_rewards)

    def eval_wins(self, rewards_chosen_P: torch.Tensor, rewards_rejected_P: torch.Tensor) -> torch.Tensor:
        return rewards_chosen_P > rewards_rejected_P
