"""Router replay's record laid onto a micro-batch's rectangle: the experts the engine chose for each
sampled token, at the position whose logits score that token (docs/moe.md, "Router replay")."""

from __future__ import annotations

import torch

from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle
from rltrain.data.batch import SequenceBatch


def recorded_experts(
    batch: SequenceBatch, rects: list[Rectangle], order_N: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """The batch's recorded routing at the positions the model routes ([B x T, layers, k], -1
    where nothing was recorded): each completion token's experts at the position whose logits
    score it; prompt positions keep the trainer's router (docs/moe.md, "Router replay"). None
    without a record."""
    if batch.routing is None:
        return None
    assert len(rects) == 1 and order_N is None, "a MoE is scored in one plain rectangle (MicroBatchLayout)"
    rect = rects[0]
    rows_BT, cols_T = rect.input_ids_BT.shape
    routing_NLK = batch.routing.values
    experts_BTLK = torch.full((rows_BT, cols_T, *routing_NLK.shape[1:]), -1, dtype=routing_NLK.dtype)
    experts_BTLK[rect.rows_N, rect.cols_N] = routing_NLK
    return experts_BTLK.flatten(0, 1).to(device)
