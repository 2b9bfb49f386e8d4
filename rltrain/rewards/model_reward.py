"""The reward model: a Hugging Face sequence classifier scoring prompt + completion.

It is one more reward function (`model`, weight `reward_model.weight`) reading decoded text, so it
needs no shared tokenizer and gets the weighting, metrics and time bound of every reward function.
Each rank scores its own slice with a frozen copy. Loading, truncation, time sharing and threads:
docs/internals/rewards.md; enabling it: docs/rewards-and-roles.md.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


class SequenceClassifierReward:
    """`fn(prompts, completions, **columns) -> list[float]`: one score per prompt + completion."""

    reads_images = False  # a text classifier (a vision-language one: rewards/vision_model_reward.py)

    def __init__(self, path: str | Path, device: torch.device, dtype: torch.dtype, batch_size: int, max_length: int) -> None:
        from transformers import AutoModelForSequenceClassification

        from rltrain.models.tokenizer import load_tokenizer

        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = max_length
        self.tokenizer = load_tokenizer(path)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token  # padding is masked; any id serves
        model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=dtype)
        # The head scores each row at its last token that is not the pad id, so the pad id the
        # model looks for must be the one the batches are padded with.
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self.device).eval().requires_grad_(False)

    def offload(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")

    def onload(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    def __call__(self, prompts: list[str], completions: list[str], **_columns: object) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        device_guard = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), device_guard:
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits_B1 = self.model(**batch).logits
                scores.extend(logits_B1[:, 0].float().cpu().tolist())
        return scores
