"""The reward model of a vision-language model: prompt + completion scored with the prompt's images.

transformers has no sequence classifier that sees images, so `algo=rm` on a vision-language model
writes the model directory plus its head (`score.safetensors`, rltrain.backends.sequence_classifier)
and this class scores as the trainer did: the prompt through the model's processor with its images,
the completion tokenized on its own, the language model's hidden state at the last token through
the head in fp32, the images placed at the prompt's placeholders only (`grid_model_inputs`).
docs/vision.md, "The reward model".
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from rltrain.backends.sequence_classifier import read_score_head
from rltrain.data.vision_inputs import VisionInputs, vision_call_inputs
from rltrain.data.vision_rows import VisionEncoder
from rltrain.models.tokenizer import load_tokenizer
from rltrain.models.vision import (
    grid_model_inputs,
    image_token_id,
    load_processor,
    load_vision_lm,
    places_by_grid,
)


class VisionSequenceReward:
    """`fn(prompts, completions, prompt_images=None, **columns) -> list[float]`: one score per
    prompt + completion, each prompt read with its images (`prompt_images[i]`: PIL images in the
    order of the prompt's placeholders; None or [] for a text-only prompt)."""

    reads_images = True  # the scorer hands it each row's images (rltrain.rewards.scoring.in_process)

    def __init__(self, path: str | Path, device: torch.device, dtype: torch.dtype, batch_size: int, max_length: int) -> None:
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.tokenizer = load_tokenizer(path)
        self.encoder = VisionEncoder(load_processor(Path(path), self.tokenizer))
        lm = load_vision_lm(Path(path), dtype)
        self.image_token = image_token_id(lm.config)
        # Rows are right-padded with any id: causal attention never lets a real token see padding after it.
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.trunk = lm.model.to(self.device).eval().requires_grad_(False)  # the LM head plays no part
        self.score_H = read_score_head(Path(path))[0].to(self.device)

    def offload(self) -> None:
        if self.device.type == "cuda":
            self.trunk.to("cpu")
            self.score_H = self.score_H.to("cpu")

    def onload(self) -> None:
        if self.device.type == "cuda":
            self.trunk.to(self.device)
            self.score_H = self.score_H.to(self.device)

    def encode(self, prompt: str, completion: str, images: list) -> tuple[list[int], int, VisionInputs | None]:
        """(ids, prompt length, images) of one row as training tokenized it: the prompt with its
        visual tokens, then the completion's own tokens. Past `max_length` the completion keeps its
        last tokens (the prompt's visual tokens cannot be cut)."""
        prompt_ids, vision = self.encoder.encode(prompt, images)
        completion_ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
        room = max(self.max_length - len(prompt_ids), 1)
        return prompt_ids + completion_ids[-room:] if completion_ids else prompt_ids, len(prompt_ids), vision

    def score_rows(self, rows: list[tuple[list[int], int, VisionInputs | None]]) -> list[float]:
        """The head on each row's last hidden state, rows right-padded into one call."""
        host = torch.device("cpu")  # assembled on the host, moved once
        lengths_B = torch.tensor([len(ids) for ids, _, _ in rows], device=host)
        ids_BT = torch.full((len(rows), int(lengths_B.max())), self.pad_id, dtype=torch.long, device=host)
        for b, (ids, _, _) in enumerate(rows):
            ids_BT[b, : len(ids)] = torch.tensor(ids, device=host)
        # Only the prompts' placeholders are images: a completion may hold the placeholder token as text.
        starts_B = torch.tensor([p for _, p, _ in rows], device=host)
        completion_BT = torch.arange(ids_BT.shape[1], device=host)[None, :] >= starts_B[:, None]
        host_images = vision_call_inputs(self.image_token, ids_BT, [v for _, _, v in rows], completion_BT)
        images = {k: v.to(self.device) for k, v in host_images.items()}
        ids_BT = ids_BT.to(self.device)
        if places_by_grid(images):  # the prompts' image slots only, as the trainer places them
            out = self.trunk(use_cache=False, **grid_model_inputs(self.trunk, ids_BT, images))
        else:
            out = self.trunk(input_ids=ids_BT, use_cache=False, **images)
        hidden_BH = out.last_hidden_state[torch.arange(len(rows), device=self.device), lengths_B.to(self.device) - 1]
        return (hidden_BH.float() @ self.score_H).cpu().tolist()

    def __call__(
        self, prompts: list[str], completions: list[str], prompt_images: list[list] | None = None, **_columns: object
    ) -> list[float]:
        images = prompt_images if prompt_images is not None else [[] for _ in prompts]
        rows = [self.encode(p, c, list(i or [])) for p, c, i in zip(prompts, completions, images, strict=True)]
        scores: list[float] = []
        device_guard = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), device_guard:
            for start in range(0, len(rows), self.batch_size):
                scores.extend(self.score_rows(rows[start : start + self.batch_size]))
        return scores
