"""SimPO: preference optimisation with no reference model.

Each completion is scored by its per-token mean log-probability under the policy (the sum over its
own length, from the ragged pipeline), and the pair loss asks the chosen one to beat the rejected
one by a margin `algo.gamma` at temperature `algo.beta` (`simpo_pair_losses`). With no reference,
one model is held in memory instead of DPO's two. Pairs, micro-batches and held-out accuracy are
rltrain/algos/preference.py's; docs/algorithms.md compares the family.

    python -m rltrain algo=simpo algo.beta=2.0 algo.gamma=1.0
"""

from __future__ import annotations

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
class SimPOConfig(AlgoConfig):
    name: str = "simpo"
    beta: float = 2.0  # temperature on the per-token mean log-probabilities
    gamma: float = 1.0  # target reward margin between chosen and rejected


def check_simpo(algo: SimPOConfig) -> None:
    if algo.beta <= 0 or algo.gamma < 0:
        raise UserError(
            f"algo.beta={algo.beta} must be positive and algo.gamma={algo.gamma} at least 0 (SimPO's temperature "
            "and target margin)."
        )


def simpo_pair_losses(
    policy_chosen_mean_P: torch.Tensor, policy_rejected_mean_P: torch.Tensor, beta: float, gamma: float
) -> torch.Tensor:
    """[P] SimPO's loss (Meng et al. 2024, eq. 6): `-log s(beta (mean_c - mean_r) - gamma)` on the
    *per-token mean* log-probabilities, so no reference is needed and length is not rewarded;
    `gamma` is the target reward margin."""
    return -F.logsigmoid(beta * (policy_chosen_mean_P - policy_rejected_mean_P) - gamma)


def make_simpo_loss(beta: float, gamma: float):
    def simpo_loss(output: PolicyOutput, batch: SequenceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n_pairs = batch.extras["global_pairs"]
        mean_c, mean_r = chosen_rejected_means(output.logps)
        loss = simpo_pair_losses(mean_c, mean_r, beta, gamma).sum() / n_pairs
        sum_c, sum_r = chosen_rejected_sums(output.logps)  # `dpo/logps_*` are sums for every objective
        return loss, pair_metrics(beta * mean_c, beta * mean_r, sum_c, sum_r, n_pairs)

    return simpo_loss


class SimPO(PairwisePreference):
    def __init__(self, ctx) -> None:
        self.loss_fn = make_simpo_loss(ctx.cfg.algo.beta, ctx.cfg.algo.gamma)
        super().__init__(ctx)
        self.eval_lengths = completion_lengths(self.data.eval)

    def eval_wins(self, policy_chosen_P: torch.Tensor, policy_rejected_P: torch.Tensor) -> torch.Tensor:
        len_c, len_r = self.eval_lengths
        return policy_chosen_P / len_c > policy_rejected_P / len_r


SPEC = AlgorithmSpec(
    "simpo", SimPOConfig, SimPO, "SimPO: length-normalised preference margin, no reference",
    data="preferences", reference="never", check=check_simpo,
)
