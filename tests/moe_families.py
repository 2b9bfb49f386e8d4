"""Tiny Hugging Face MoE checkpoints of the families rltrain loads by `model.path` (Qwen2-MoE,
Qwen3-MoE, Mixtral, OLMoE), built in the tests: 4 experts, top-2, head size 32 (vLLM's CPU
attention), decisive routing (the routers' weights drawn large, so a perturbation that moves a
token's experts shows)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128  # the character tokenizer's padded vocabulary
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def family_config(family: str):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "qwen2_moe":  # with its shared expert
        return Qwen2MoeConfig(
            **SHAPE, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2,
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**SHAPE, intermediate_size=64, moe_intermediate_size=32, head_dim=32, num_experts=4, num_experts_per_tok=2)
    if family == "mixtral":
        return MixtralConfig(**SHAPE, intermediate_size=32, head_dim=32, num_local_experts=4, num_experts_per_tok=2)
    if family == "olmoe":
        return OlmoeConfig(**SHAPE, intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    raise ValueError(family)


FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"]


def build_family_dir(family: str, directory: Path, seed: int = 0) -> Path:
    """Save a tiny `family` MoE (weights and the character tokenizer) into `directory`, once."""
    from transformers import AutoModelForCausalLM

    from rltrain.models.tokenizer import build_char_tokenizer

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0.0, 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    build_char_tokenizer().save_pretrained(directory)
    return directory
