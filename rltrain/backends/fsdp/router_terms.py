"""A MoE model's router terms added to one micro-batch's loss and metrics in the FSDP engine.

Per-micro-batch means scaled by `share` so their sum over micro-batches and ranks is the mean; the
router-agreement counts ride on every MoE micro-batch so every rank logs the same keys. docs/moe.md.
"""

from __future__ import annotations

import torch

from rltrain.backends.base import LossMetrics, PolicyOutput
from rltrain.models.moe import MoEInfo


def with_router_terms(
    loss: torch.Tensor, metrics: LossMetrics, out: PolicyOutput, moe_info: MoEInfo, share: float
) -> tuple[torch.Tensor, LossMetrics]:
    """`loss` plus the weighted aux and z losses; `metrics` plus those, the load imbalance and the
    router replay's (agreed, recorded) token-layer pairs (zero where nothing was recorded)."""
    if out.aux_loss is not None:
        loss = loss + moe_info.aux_loss_coef * share * out.aux_loss
        metrics = {**metrics, "moe/aux_loss": out.aux_loss.detach() * share}
    if out.z_loss is not None:
        loss = loss + moe_info.z_loss_coef * share * out.z_loss
        metrics = {**metrics, "moe/z_loss": out.z_loss.detach() * share}
    if out.load_imbalance is not None:
        metrics = {**metrics, "moe/load_imbalance": out.load_imbalance * share}
    agreed_recorded = out.router_agreement if out.router_agreement is not None else torch.zeros(2, dtype=torch.float64)
    return loss, {**metrics, "moe/router_agreed": agreed_recorded[0], "moe/router_recorded": agreed_recorded[1]}
