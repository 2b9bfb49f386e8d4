"""Reward-model training: a Bradley-Terry model of preference pairs, saved for PPO and GRPO.

The model is the policy's with a bias-free scalar head for its LM head (a value engine). A
sequence's reward is the head on the state predicting its last completion token (the EOS), i.e.
the last text token's, where the sequence classifier in `final/` reads it when `reward_model=hf`
scores decoded text (a vision-language model's, with each row's images: docs/vision.md). Pairs
and held-out accuracy: rltrain/algos/preference.py; docs/algorithms.md, "Reward model".

    python -m rltrain algo=rm
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rltrain.algos.preference import PairwisePreference, score_pairs
from rltrain.backends.base import PolicyOutput
from rltrain.config.algorithms import AlgoConfig, AlgorithmSpec
from rltrain.config.run_context import RunContext
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged
from rltrain.runtime.errors import UserError


@dataclass
class RewardModelConfig(AlgoConfig):
    """Bradley-Terry reward-model training on preference pairs."""

    name: str = "rm"
    # TRL's center_rewards_coefficient: this times the mean of (r_chosen + r_rejected)^2 keeps the
    # scores near zero (the pair loss sees only their difference); 0 turns it off.
    center_rewards_coefficient: float = 0.0


def check_rm(algo: RewardModelConfig) -> None:
    if algo.center_rewards_coefficient < 0:
        raise UserError(
            f"algo.center_rewards_coefficient={algo.center_rewards_coefficient} must be at least 0 (0: no centering)."
        )


def reward_pair_losses(
    rewards_chosen_P: torch.Tensor,
    rewards_rejected_P: torch.Tensor,
    margins_P: torch.Tensor | None = None,
    center_coefficient: float = 0.0,
) -> torch.Tensor:
    """[P] the Bradley-Terry loss of a reward model's scores, `-log s(r_c - r_r - margin)`, plus
    `center_coefficient * (r_c + r_r)^2`, which pins the scores' free offset near zero (the pair
    term sees only differences). The optional per-pair `margins_P` asks for a wider gap where the
    data says the preference is strong (Llama 2's margin, as TRL's RewardTrainer applies it)."""
    diff_P = rewards_chosen_P.float() - rewards_rejected_P.float()
    if margins_P is not None:
        diff_P = diff_P - margins_P.to(diff_P.device, diff_P.dtype)
    losses_P = -F.logsigmoid(diff_P)
    if center_coefficient:
        losses_P = losses_P + center_coefficient * (rewards_chosen_P.float() + rewards_rejected_P.float()) ** 2
    return losses_P


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

    def __init__(self, ctx: RunContext) -> None:
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


SPEC = AlgorithmSpec(
    "rm", RewardModelConfig, RewardModel, "Bradley-Terry reward model on preference pairs (a sequence classifier)",
    data="preferences", reference="never", head="scalar", check=check_rm,
)
