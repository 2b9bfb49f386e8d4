"""Greedy exact-match evaluation, backend-agnostic.

Each rank loads the policy's full weights (through the engine's `export_weights`, a collective)
into a plain, unsharded copy of the model *on its training device*, generates greedily for its
slice of the held-out prompts with no collectives at all, and one all-reduce sums the correct
answers. Generation under FSDP would run a collective per token per layer; this runs none. The copy
exists only while evaluating (built, loaded, used and dropped in `accuracy`), so it never holds
memory during training. Besides the accuracy, a call returns a few of this rank's greedy
completions as samples (reward 1 for an exact match, else 0) for the W&B sample tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rltrain.data.sharding import rank_slice
from rltrain.data.vision_inputs import VisionInputs, vision_call_inputs
from rltrain.models import moe
from rltrain.models.vision import image_token_id, is_vision_config, vision_auto_class
from rltrain.run.samples import MAX_SAMPLES, Sample, first_samples
from rltrain.runtime.distributed import all_reduce_sum

if TYPE_CHECKING:
    from rltrain.models.hf_io import GenerativeLM


@dataclass
class GreedyResult:
    accuracy: float  # over every rank's slice, identical on every rank
    samples: list[Sample]  # the first of this rank's completions


class GreedyEvaluator:
    def __init__(
        self, model_dir, tokenizer, dtype: torch.dtype, max_new_tokens: int, device: torch.device | str = "cpu"
    ) -> None:
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(str(model_dir))
        self.dtype = dtype
        self.device = torch.device(device)
        self.model: GenerativeLM | None = None  # built by `load`, dropped by `release`
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens

    def load(self, engine) -> None:
        """Build the copy on the training device and load the policy's current weights into it."""
        from transformers import AutoModelForCausalLM

        weights = dict(engine.export_weights())  # collective: every rank takes part
        auto = vision_auto_class() if is_vision_config(self.config) else AutoModelForCausalLM
        with torch.device(self.device):
            model = auto.from_config(self.config, dtype=self.dtype, attn_implementation="sdpa")
        model.eval().requires_grad_(False)
        missing, unexpected = moe.load_checkpoint_weights(model, weights)  # a MoE's experts come per expert
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise RuntimeError(f"evaluation copy: missing {missing}, unexpected {unexpected}")
        if model.config.tie_word_embeddings:
            model.tie_weights()
        self.model = model

    def release(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], batch_size: int = 64, images: list[VisionInputs | None] | None = None
    ) -> list[str]:
        """Greedy completions; `images`: each prompt's encoded images (a vision-language model)."""
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        texts: list[str] = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
            assert self.model is not None, "GreedyEvaluator.generate before load"
            seen = vision_call_inputs(image_token_id(self.config), ids, images[start : start + batch_size] if images else [])
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                **{k: v.to(self.device) for k, v in seen.items()},
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=eos,
            )
            for row in out[:, width:].tolist():
                if eos in row:
                    row = row[: row.index(eos)]
                texts.append(self.tokenizer.decode(row, skip_special_tokens=True))
        return texts

    def accuracy(
        self, engine, prompts: list[list[int]], references: list[str], images: list[VisionInputs | None] | None = None
    ) -> GreedyResult:
        """Exact-match accuracy over all ranks' slices, and samples of this rank's completions;
        `images`: each prompt's encoded images, for a vision-language model."""
        self.load(engine)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = rank_slice(list(range(len(prompts))), rank, world)
        try:
            mine_images = [images[i] for i in mine] if images else None
            outputs = self.generate([prompts[i] for i in mine], images=mine_images) if mine else []
        finally:
            self.release()
        hits = [float(out.strip() == references[i].strip()) for out, i in zip(outputs, mine)]
        counts = all_reduce_sum(torch.tensor([sum(hits), len(mine)], dtype=torch.float64, device="cpu"))
        shown = [self.tokenizer.decode(prompts[i], skip_special_tokens=True) for i in mine[:MAX_SAMPLES]]
        samples = first_samples(shown, outputs, hits)
        return GreedyResult(float(counts[0] / counts[1].clamp(min=1)), samples)
