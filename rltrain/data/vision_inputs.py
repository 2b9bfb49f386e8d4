"""One row's images, encoded by the model's processor, riding with the row.

Visual tokens differ per row (image sizes and counts differ), so every row carries its own
processor tensors (`pixel_values`, `image_grid_thw`, ...) in its batch's `extras[VISION]` list;
selecting rows (micro-batches, token budgets, rank slices) moves them with their rows, and only the
model call concatenates them, in row order. docs/vision.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VISION = "vision"  # the SequenceBatch.extras key: one VisionInputs (or None: no image) per sequence


@dataclass
class VisionInputs:
    """A row's images as its model's forward takes them, every tensor's first dimension running
    over this row's images or image patches (so rows concatenate along it)."""

    tensors: dict[str, torch.Tensor]
    num_images: int

    def to(self, device: torch.device | str) -> VisionInputs:
        return VisionInputs({k: v.to(device) for k, v in self.tensors.items()}, self.num_images)


def batch_has_images(extras: dict) -> bool:
    rows = extras.get(VISION)
    return rows is not None and any(r is not None for r in rows)


def concatenate(rows: list[VisionInputs | None]) -> dict[str, torch.Tensor]:
    """The model-call inputs of rows in this order: each key's tensors concatenated along their
    first dimension, rows without images skipped."""
    present = [r for r in rows if r is not None]
    if not present:
        return {}
    keys = present[0].tensors.keys()
    if any(r.tensors.keys() != keys for r in present):
        raise ValueError(f"rows carry different image inputs: {sorted({k for r in present for k in r.tensors})}")
    return {k: torch.cat([r.tensors[k] for r in present]) for k in keys}


def vision_extras(rows: list[VisionInputs | None]) -> dict[str, list[VisionInputs | None]]:
    """The SequenceBatch extras that carry these rows' images ({} when none has any)."""
    return {VISION: rows} if any(r is not None for r in rows) else {}


def vision_call_inputs(
    image_token: int | None, ids_BT: torch.Tensor, rows: list[VisionInputs | None], sampled_BT: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The image inputs of a model call over `ids_BT` (its rows' ids, padded) from the rows' images:
    concatenated in row order, plus `mm_token_type_ids` (1 on image tokens) for models that place
    visual tokens by image grids (the Qwen2-VL family). {} when no row has an image. `sampled_BT`
    (True on the tokens the policy sampled): those are never image tokens, since a completion may
    sample the placeholder token and the rollout engine took it as text; the prompts' and the
    observations' placeholders are the images'."""
    inputs = concatenate(rows)
    if "image_grid_thw" in inputs and image_token is not None:
        image_BT = ids_BT == image_token
        if sampled_BT is not None:
            image_BT &= ~sampled_BT.to(ids_BT.device)
        inputs["mm_token_type_ids"] = image_BT.to(torch.int32)
    return inputs
