"""A micro-batch with images meets the model as one right-padded rectangle, each row's images
concatenated in row order beside it.

No shared-prompt packing, padding-free row or length buckets for such a batch: a vision-language
model derives each row's (M-RoPE) positions from that row's own tokens and image grids, which those
layouts would merge. docs/vision.md.
"""

from __future__ import annotations

import torch

from rltrain.backends.fsdp.hf_scoring import completion_positions
from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle
from rltrain.data.batch import SequenceBatch
from rltrain.data.vision_inputs import VISION, vision_call_inputs


def vision_rectangle(batch: SequenceBatch, pad_id: int, image_token_id: int | None) -> Rectangle:
    """The batch padded to its longest row, with its rows' image inputs; models with image grids
    (the Qwen2-VL family) also get `mm_token_type_ids` (1 on the image tokens the policy did not
    sample: the prompts' and an episode's observations'), where the scorer places the image features
    and from which it takes M-RoPE positions (rltrain.models.vision.grid_model_inputs)."""
    ids_BT, _ = batch.tokens.to_padded(pad_id)
    rows_N, cols_N, _ = completion_positions(batch)
    device = ids_BT.device
    sampled_BT = torch.zeros(ids_BT.shape, dtype=torch.bool, device=device)
    at = (rows_N.to(device), (cols_N + 1).to(device))
    sampled_BT[at] = batch.sampled.values.to(device, torch.bool) if batch.sampled is not None else True
    return Rectangle(ids_BT, rows_N, cols_N, model_inputs=vision_call_inputs(image_token_id, ids_BT, batch.extras[VISION], sampled_BT))
