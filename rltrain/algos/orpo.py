"""ORPO: supervised fine-tuning and preference in one loss, with no reference model.

The loss is the chosen completions' NLL per token (as SFT computes it) plus `algo.lambda_` times
the odds-ratio term `-log s(log odds_c - log odds_r)`, the odds of a completion taken from its
per-token mean log-probability (`orpo_pair_losses`). With no reference, one model is held in memory
instead of DPO's two. Pairs, micro-batches and held-out accuracy are rltrain/algos/preference.py's;
docs/algorithms.md compares the family.

    python -m rltrain algo=orpo algo.lambda_=0.1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rltrain.algos.preference import (
    PairwisePreference,
    chosen_rejected_means,
    chosen_rejected_sums,
    completion_lengths,
    pair_metrics,
)
from rltrain.backends.base import PolicyOutput
from rltrain.config.algorithms import AlgoConfig, AlgorithmSpec
from rltrain.data.batch import SequenceBatch
from rltrain.runtime.errors import UserError


@dataclass
class ORPOConfig(AlgoConfig):
    name: str = "orpo"
    lambda_: float = 0.1  # weight of the odds-ratio term next to the chosen completions' NLL


def check_orpo(algo: ORPOConfig) -> None:
    if algo.lambda_ < 0:
        raise UserError(f"algo.lambda_={algo.lambda_} must be at least 0 (the odds-ratio term's weight; 0 is plain SFT).")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012: expm1 near 0, log1p far)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_log_odds_ratio(policy_chosen_mean_P: torch.Tensor, policy_rejected_mean_P: torch.Tensor) -> torch.Tensor:
    """[P] ORPO's log odds ratio (Hong et al. 2024, eq. 4-6) of the per-token mean log-probabilities
    `m`: `log(odds_c / odds_r)` with `odds = p / (1 - p)`, `p = exp(m)`, in log space."""
    c_P, r_P = policy_chosen_mean_P.float(), policy_rejected_mean_P.float()
    return (c_P - r_P) - (log1mexp(c_P) - log1mexp(r_P))


def orpo_pair_losses(policy_chosen_mean_P: torch.Tensor, policy_rejected_mean_P: torch.Tensor) -> torch.Tensor:
    """[P] ORPO's odds-ratio term `-log s(log odds ratio)` (eq. 7), weighted by `algo.lambda_` and
    added to the chosen completions' NLL by the caller."""
    return -F.logsigmoid(orpo_log_odds_ratio(policy_chosen_mean_P, policy_rejected_mean_P))


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


SPEC = AlgorithmSpec(
    "orpo", ORPOConfig, ORPO, "ORPO: SFT plus an odds-ratio preference term, no reference",
    data="preferences", reference="never", check=check_orpo,
)
