"""How one FSDP micro-batch meets the model: packed rows of shared prompts, one padding-free row,
length buckets, or one padded rectangle (`MicroBatchLayout`). The scorer
(rltrain/backends/fsdp/hf_scoring.py) runs one model call per rectangle and `order_N` restores the
ragged order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.backends.fsdp.hf_scoring import BUCKET_COST_TOKENS, bucket_rectangles, completion_positions
from rltrain.backends.fsdp.micro_batches.padding_free import padding_free_rectangle
from rltrain.backends.fsdp.micro_batches.shared_prefix import (
    PackingCost,
    Rectangle,
    packed_rectangles,
    shared_prompt_groups,
)
from rltrain.backends.fsdp.micro_batches.vision_layout import vision_rectangle
from rltrain.data.batch import SequenceBatch, length_buckets
from rltrain.data.vision_inputs import batch_has_images


@dataclass
class MicroBatchLayout:
    pad_id: int
    share_prompts: bool  # pack sequences that share a prompt (never for MoE)
    packing_cost: PackingCost
    # Length buckets costed at this many tokens per extra model call, or None (one rectangle).
    bucket_cost: int | None
    # Unshared sequences as one packed row with document-masked attention (backend.padding_free;
    # never for MoE), in place of a padded rectangle or length buckets.
    padding_free: bool = False
    image_token_id: int | None = None  # a vision-language model's image token (vision_layout)
    # Packed rows (padding-free, shared-prompt) padded to one of a few widths (widths.packed_width): on
    # for a compiled model (flex_attention on CUDA, backend.compile), which compiles once per width.
    round_packed_widths: bool = False

    @staticmethod
    def for_model(
        hf_config,
        pad_id: int,
        device: torch.device,
        sharded: bool,
        moe: bool,
        padding_free: bool = False,
        share_prompts: bool = True,
        length_buckets: bool = True,
        image_token_id: int | None = None,
        round_packed_widths: bool = False,
    ) -> MicroBatchLayout:
        """The layout for a model, from the backend's switches (`backend.padding_free`,
        `backend.share_prompts`, `backend.length_buckets`) and what the model allows."""
        bucket_cost = None
        if length_buckets and not sharded and not moe:
            bucket_cost = BUCKET_COST_TOKENS.get(device.type, BUCKET_COST_TOKENS["cpu"])
        return MicroBatchLayout(
            pad_id, share_prompts and not moe, PackingCost.from_config(hf_config), bucket_cost, padding_free and not moe,
            image_token_id, round_packed_widths,
        )

    def __call__(self, batch: SequenceBatch) -> tuple[list[Rectangle], torch.Tensor | None, torch.Tensor | None]:
        """How one micro-batch meets the model: (rectangles, order_N, padding mask).

        Sequences that share a prompt (GRPO groups, DPO pairs) are packed one row per prompt,
        so each prompt is computed once (rltrain.backends.fsdp.micro_batches.shared_prefix); this wins over
        padding-free whenever it applies. Otherwise, with `padding_free`, one packed row with
        document-masked attention (rltrain.backends.fsdp.micro_batches.padding_free); else one padded rectangle, or
        on one rank length buckets (`_length_groups`). Sharded ranks always make one model call
        per micro-batch: FSDP all-gathers once per call, so ranks with different call counts
        would fall out of step in their collectives. A MoE model is never packed or bucketed:
        its load-balancing loss is computed over one plain rectangle.
        Rows with images always make one padded rectangle (rltrain.backends.fsdp.micro_batches.vision_layout).
        """
        if batch_has_images(batch.extras):
            return [vision_rectangle(batch, self.pad_id, self.image_token_id)], None, None
        if self.share_prompts and (shared := shared_prompt_groups(batch, self.packing_cost)) is not None:
            return (*packed_rectangles(batch, shared, self.pad_id, self.bucket_cost, self.round_packed_widths), None)
        if self.padding_free:
            return [padding_free_rectangle(batch, self.pad_id, self.round_packed_widths)], None, None
        groups = self._length_groups(batch)
        if groups is None:
            ids_BT, mask_BT = batch.tokens.to_padded(self.pad_id)
            rows, cols, _ = completion_positions(batch)
            return [Rectangle(ids_BT, rows, cols)], None, mask_BT
        rects, order_N = bucket_rectangles(batch, groups, self.pad_id)
        return rects, order_N, None

    def _length_groups(self, batch: SequenceBatch) -> list[list[int]] | None:
        """Length buckets for one forward (None: one padded rectangle, the original order).

        Why: a micro-batch padded to its longest sequence spends most of its extra compute on
        padding when lengths are spread (30-250 tokens: ~1.7x the real tokens); scoring a few
        rectangles of similar lengths and restoring the ragged order gives the same
        log-probabilities (to fp32 round-off) for a fraction of the compute. Only on one unsharded
        rank: sharded FSDP units all-gather once per call, so ranks with different bucket counts
        would fall out of step in their collectives. Not for MoE, whose load-balancing loss is
        computed over one rectangle's router logits.
        """
        if self.bucket_cost is None or len(batch) < 2:
            return None
        groups = length_buckets(batch.tokens.lengths().tolist(), self.bucket_cost)
        return groups if len(groups) > 1 else None
