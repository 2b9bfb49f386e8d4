"""Greedy exact-match evaluation, backend-agnostic.

Each rank loads the policy's full weights (through the engine's `export_weights`, a collective)
into a plain, unsharded copy of the model, generates greedily for its slice of the held-out
prompts with no collectives at all, and one all-reduce sums the correct answers. Generation
under FSDP would run a collective per token per layer; this runs none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rltrain.data.sharding import rank_slice


class GreedyEvaluator:
    def __init__(self, model_dir, tokenizer, dtype: torch.dtype, max_new_tokens: int) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens

    def load(self, engine) -> None:
        weights = dict(engine.export_weights())
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise RuntimeError(f"evaluation copy: missing {missing}, unexpected {unexpected}")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], batch_size: int = 64) -> list[str]:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        texts: list[str] = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
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

    def accuracy(self, engine, prompts: list[list[int]], references: list[str]) -> float:
        """Exact-match accuracy over all ranks' slices (identical result on every rank)."""
        self.load(engine)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = rank_slice(list(range(len(prompts))), rank, world)
        outputs = self.generate([prompts[i] for i in mine]) if mine else []
        correct = sum(int(out.strip() == references[i].strip()) for out, i in zip(outputs, mine))
        counts = torch.tensor([correct, len(mine)], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(counts)
        return float(counts[0] / counts[1].clamp(min=1))
