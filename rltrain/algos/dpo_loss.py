"""DPO-family losses on per-sequence log-probability sums (pure functions).

Inputs are the *summed* completion-token log-probabilities of each chosen and rejected completion
under the policy and the frozen reference, reduced from ragged per-token values with their own
lengths (chosen and rejected are never padded to each other). With
`h = (logp_c - ref_c) - (logp_r - ref_r)`:

- `sigmoid` (Rafailov et al. 2023; label smoothing eps as conservative DPO):
  `-(1-eps) log s(beta h) - eps log s(-beta h)`
- `robust` (Chowdhury et al. 2024, unbiased under label-flip rate eps):
  `(-(1-eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)`
- `hinge` (SLiC, Zhao et al. 2023): `max(0, 1 - beta h)`
- `ipo` (Azar et al. 2023), on summed log-ratios as in the paper: `(h - 1/(2 beta))^2`

Implicit rewards are `beta (logp - ref)`; they are what `dpo/rewards_*`, `dpo/margin` and
`dpo/accuracy` report.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def dpo_pair_losses(
    policy_chosen_P: torch.Tensor,
    policy_rejected_P: torch.Tensor,
    ref_chosen_P: torch.Tensor,
    ref_rejected_P: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """[P] loss of each pair."""
    h_P = (policy_chosen_P - ref_chosen_P) - (policy_rejected_P - ref_rejected_P)
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * h_P) - eps * F.logsigmoid(-beta * h_P)
    if loss_type == "robust":
        if not 0 <= eps < 0.5:
            raise ValueError(f"algo.label_smoothing={eps} must be in [0, 0.5) for the robust loss")
        return (-(1 - eps) * F.logsigmoid(beta * h_P) + eps * F.logsigmoid(-beta * h_P)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return torch.relu(1 - beta * h_P)
    if loss_type == "ipo":
        return (h_P - 1 / (2 * beta)) ** 2
    raise ValueError(f"algo.loss_type={loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")


def implicit_rewards(policy_P: torch.Tensor, ref_P: torch.Tensor, beta: float) -> torch.Tensor:
    return beta * (policy_P - ref_P)
