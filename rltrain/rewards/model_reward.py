"""The reward model: a Hugging Face sequence classifier scoring prompt + completion.

`reward_model=hf reward_model.path=DIR` loads `AutoModelForSequenceClassification` (one output,
`num_labels=1`, checked in rltrain/config/validate.py) and its own tokenizer from DIR, so it need not share
the policy's tokenizer: it reads the decoded text `prompt + completion`, as a reward function does.
It is one more reward function (`RewardFn` named `model`, weight `reward_model.weight`), so the total
reward, the `reward/model` metric, the empty-slice rule and the `reward.timeout_s` bound are those of
every reward function (rltrain/rewards/__init__.py).

Every rank holds the whole model (frozen, in eval mode) on its training device and scores its own
slice of completions in batches of `reward_model.batch_size` texts. Texts longer than
`reward_model.max_length` tokens lose their *beginning*: a classifier scores at the last token, so
the end of the completion is what must survive. Weights load in the run's compute dtype (fp32 on
CPU, bf16 under `bf16-mixed` on CUDA); scores are returned in fp32 whatever the dtype.

With time sharing it gives the device up for the rollout engine's turn (`offload`/`onload`,
rltrain/sync/timeshare.py): rewards are scored after the turn, so it is never needed while the engine
runs. On CPU there is nowhere else to put it and both are no-ops.

The call runs in the reward-timeout worker thread (a fresh thread per call), and grad mode and the
current CUDA device are per-thread in torch, so both are set inside the call, not at load time.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


class SequenceClassifierReward:
    """`fn(prompts, completions, **columns) -> list[float]`: one score per prompt + completion."""

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
