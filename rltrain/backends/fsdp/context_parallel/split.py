"""One rectangle's tokens split over the cp ranks, and the scored positions gathered back.

Every cp rank holds the whole micro-batch (a cp group is one data-parallel replica), pads each row
to a multiple of cp, runs the model on its contiguous slice of positions and scores the completion
tokens predicted there. The scores are gathered so every cp rank hands the algorithm the same full
ragged tensor it would see at cp=1; the gather's backward keeps only this rank's slice, so the cp
ranks' gradients add up to the full one (FSDP sums them). docs/long-sequences.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rltrain.backends.fsdp.context_parallel.ulysses import CPAttention
from rltrain.backends.fsdp.micro_batches.attention_masks import document_causal_mask
from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle


@dataclass
class SlicedCall:
    """What this rank feeds the model for one rectangle, and which scored positions it computes."""

    input_ids_BL: torch.Tensor  # L = T / cp: this rank's slice of the padded row
    position_ids_BL: torch.Tensor
    attention: CPAttention
    rows_n: torch.Tensor  # this rank's scored positions, in the rectangle's order
    cols_n: torch.Tensor  # ...as columns of the slice
    owner_N: torch.Tensor  # the cp rank that scores each of the rectangle's positions


def padded_width(width: int, cp: int) -> int:
    return -(-width // cp) * cp


def _row_mask(rect: Rectangle, width: int) -> torch.Tensor | None:
    """The rectangle's attention mask over the padded width (None: plain causal, right padding
    unseen). Padding columns form a document of their own (they see only padding)."""
    rows, old = rect.input_ids_BT.shape
    extra = width - old
    if rect.document_ids_BT is not None:
        ids_BT = rect.document_ids_BT
        if extra:
            ids_BT = torch.cat([ids_BT, ids_BT.new_full((rows, extra), int(ids_BT.max()) + 1)], dim=1)
        return document_causal_mask(ids_BT)
    if rect.attention_mask_B1TT is None:
        return None
    mask = rect.attention_mask_B1TT
    if extra:
        mask = torch.nn.functional.pad(mask, (0, extra, 0, extra), value=False)
        idx = torch.arange(old, width, device=mask.device)
        mask[:, :, idx, idx] = True
    return mask


def slice_rectangle(rect: Rectangle, cp_rank: int, cp: int, group: dist.ProcessGroup) -> SlicedCall:
    """This rank's slice of `rect` (on its device already)."""
    if rect.model_inputs:
        raise ValueError("context parallelism does not split rows with images (vision-language models)")
    rows, width = rect.input_ids_BT.shape
    full = padded_width(width, cp)
    local = full // cp
    device = rect.input_ids_BT.device
    ids_BT = torch.nn.functional.pad(rect.input_ids_BT, (0, full - width), value=0)
    if rect.position_ids_BT is None:
        positions_BT = torch.arange(full, device=device).expand(rows, full)
    else:  # padding continues each row's last position (never attended to by a real token)
        tail = rect.position_ids_BT[:, -1:] + torch.arange(1, full - width + 1, device=device)
        positions_BT = torch.cat([rect.position_ids_BT, tail], dim=1)
    start = cp_rank * local
    owner_N = torch.div(rect.cols_N, local, rounding_mode="floor")
    mine_N = owner_N == cp_rank
    return SlicedCall(
        ids_BT[:, start : start + local],
        positions_BT[:, start : start + local],
        CPAttention(group, cp, _row_mask(rect, full)),
        rect.rows_N[mine_N],
        rect.cols_N[mine_N] - start,
        owner_N,
    )


class GatherScored(torch.autograd.Function):
    """Per-position values scored on each cp rank -> the rectangle's full [N], on every cp rank.
    Backward: this rank's positions' gradient only (every cp rank computes the same loss)."""

    @staticmethod
    def forward(ctx: Any, local_n: torch.Tensor, owner_N: torch.Tensor, cp_rank: int, cp: int, group: dist.ProcessGroup):
        counts = torch.bincount(owner_N, minlength=cp).tolist()
        most = max(1, max(counts))
        sent = torch.zeros(most, dtype=local_n.dtype, device=local_n.device)
        sent[: local_n.numel()] = local_n
        received = [torch.empty_like(sent) for _ in range(cp)]
        dist.all_gather(received, sent, group=group)
        full_N = torch.empty(owner_N.numel(), dtype=local_n.dtype, device=local_n.device)
        for r in range(cp):
            full_N[owner_N == r] = received[r][: counts[r]]
        ctx.save_for_backward(owner_N == cp_rank)
        return full_N

    @staticmethod
    def backward(ctx: Any, grad_N: torch.Tensor):
        (mine_N,) = ctx.saved_tensors
        return grad_N[mine_N], None, None, None, None
