"""`rollout=hf` with images: the model directory's image processor turns each row's images into
`pixel_values` and `image_grid_thw`, and the rows into what transformers' generate needs.

The Qwen2-VL family (an image processor that reports each image's patch grid): a row given with
one placeholder per image is expanded to one placeholder per visual token, as the vLLM engine
does, and its completions carry that prompt. `mm_token_type_ids` marks the prompt's image
positions, so a sampled placeholder token is text, as in vLLM. docs/vision.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rltrain.rollout.images import PromptImages, check_batch, collapse_placeholders, placeholder_runs


class ImageInputs:
    """The image processor of a vision-language model directory, for `HFRolloutEngine`."""

    def __init__(self, model_dir: str | Path, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        self.processor: Any = AutoImageProcessor.from_pretrained(str(model_dir))
        self.image_token_id = image_token_id
        self.merge = int(self.processor.merge_size)  # visual tokens are merge x merge patches
        # The last call's distinct image objects and their tensors: `expand` and `tensors` of one
        # generate see the same images. Holding the objects keeps their ids from being reused.
        self._last: tuple[list[Any], dict[str, torch.Tensor]] = ([], {})

    def pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """`pixel_values` and `image_grid_thw` of `images`, in order."""
        return dict(self.processor(images=list(images), return_tensors="pt"))

    def distinct_pixels(self, images: Sequence[Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(for each image the index of its distinct object, `pixels` of the distinct objects): a
        prompt's `n` sampled rows repeat its images, and resizing costs as much as the tower here."""
        first: dict[int, int] = {}
        source = [first.setdefault(id(image), len(first)) for image in images]
        distinct = list({id(image): image for image in images}.values())
        seen, out = self._last
        if len(seen) != len(distinct) or any(a is not b for a, b in zip(seen, distinct)):
            out = self.pixels(distinct)
            self._last = (distinct, out)
        return source, out

    def expand(
        self, prompts: Sequence[Sequence[int]], images: Sequence[PromptImages] | None
    ) -> tuple[list[list[int]], list[list[int] | None]]:
        """Each prompt with its placeholders expanded, and per prompt the expanded ids where they
        differ from the prompt given (else None)."""
        check_batch(prompts, images)
        flat = [image for mine in images or [] for image in mine]
        source, out = self.distinct_pixels(flat) if flat else ([], {})
        grids = iter(out["image_grid_thw"][source]) if flat else iter(())
        rows, expanded = [], []
        for i, ids in enumerate(prompts):
            row = [int(t) for t in ids]
            mine = images[i] if images else []
            if mine:
                row = self._expand_row(i, row, mine, [next(grids) for _ in mine])
            rows.append(row)
            expanded.append(row if row != list(ids) else None)
        return rows, expanded

    def _expand_row(self, index: int, ids: list[int], images: PromptImages, grid: list[torch.Tensor]) -> list[int]:
        per_image = [int(g.prod()) // self.merge**2 for g in grid]
        given = sum(t == self.image_token_id for t in ids)
        runs = placeholder_runs(ids, self.image_token_id)
        if runs == len(images) and given == sum(per_image):
            return ids
        if runs != len(images) or collapse_placeholders(ids, self.image_token_id) != ids:
            raise ValueError(
                f"prompt {index} has {given} image token(s) in {runs} placeholder(s) for {len(images)} image(s) "
                f"that take {per_image} visual tokens: give the processor's expanded ids or one placeholder per image"
            )
        counts = iter(per_image)
        return [t for tok in ids for t in ([tok] * next(counts) if tok == self.image_token_id else [tok])]

    def tensors(self, row_images: Sequence[PromptImages], ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, Any]:
        """generate's image arguments for a left-padded batch whose row r has `row_images[r]`;
        empty when no row has an image."""
        flat = [image for images in row_images for image in images]
        if not flat:
            return {}
        mm_BT = ((ids_BT == self.image_token_id) & mask_BT.bool()).long()
        return {**self.repeated_pixels(flat), "mm_token_type_ids": mm_BT}

    def repeated_pixels(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """`pixels(images)`, each distinct image object processed once (`distinct_pixels`)."""
        source, out = self.distinct_pixels(images)
        if source == list(range(len(images))):  # nothing repeated
            return out
        if set(out) != {"pixel_values", "image_grid_thw"}:  # not a patch-grid layout: rows by image
            return self.pixels(images)
        patches = torch.split(out["pixel_values"], out["image_grid_thw"].prod(-1).tolist())
        return {"pixel_values": torch.cat([patches[i] for i in source]), "image_grid_thw": out["image_grid_thw"][source]}
