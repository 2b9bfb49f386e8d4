"""ORPO: supervised fine-tuning and preference in one loss, with no reference model.

The loss is the chosen completions' NLL per token (as SFT computes it) plus `algo.lambda_` times
the odds-ratio term `-log s(log odds_c - log odds_r)`, the odds of a completion taken from its
per-token mean log-probability (`orpo_pair_losses`). With no reference, one model is held in memory
instead of DPO's two. Pairs, micro-batches and held-out accuracy are rltrain/algos/preference.py's;
docs/algorithms.md compares the family.

    python -m rltrain algo=orpo algo.lambda_=0.1
"""

from __future__ import annotations

import torch

from rltrain.algos.losses import orpo_log_odds_ratio, orpo_pair_losses
from rltrain.algos.preference import (
    PairwisePreference,
    chosen_rejected_means,
    chosen_rejected_sums,
    completion_lengths,
    pair_metrics,
)
from rltrain.backends.base import PolicyOutput
from rltrain.data.batch import SequenceBatch


def make_orpo_loss(lambda_: float):
    def orpo_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n_pairs = batch.extras["global_pairs"]
        sum_c, sum_r = chosen_rejected_sums(output.logps)
        mean_c, mean_r = chosen_rejected_means(output.logps)
        nll = -sum_c.sum() / batch.extras["global_chosen_tokens"]
        odds_ratio_term = orpo_pair_losses(mean_c, mean_r).sum() / n_pairs
        metrics = pair_metrics(lambda_ * mean_c, lambda_ * mean_r, sum_c, sum_r, n_pairs)
        metrics["orpo/nll"] = nll.detach()
        metrics["orpo/odds_ratio_loss"] = odds_ratio_term.detach()
        metrics["orpo/log_odds_ratio"] = orpo_log_odds_ratio(mean_c, mean_r).detach().sum() / n_pairs
        return nll + lambda_ * odds_ratio_term, metrics

    return orpo_loss


class ORPO(PairwisePreference):
    def __init__(self, ctx) -> None:
        self.loss_fn = make_orpo_loss(ctx.cfg.algo.lambda_)
        super().__init__(ctx)
        self.eval_lengths = completion_lengths(self.data.eval)

    def eval_wins(self, policy_chosen_P: torch.Tensor, policy_rejected_P: torch.Tensor) -> torch.Tensor:
        """The odds ratio favours the chosen completion exactly when its mean log-probability is the
        higher one (the odds are increasing in it)."""
        len_c, len_r = self.eval_lengths
        return policy_chosen_P / len_c > policy_rejected_P / len_r
