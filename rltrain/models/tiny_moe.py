"""The embedded Mixture-of-Experts model (model=tiny_moe): a tiny Qwen3-MoE built locally,
deterministic from the seed, with the character tokenizer.

Every decoder layer is sparse (`model.moe.num_experts` experts, top `model.moe.experts_per_token`),
saved as a normal Hugging Face directory and cached by shape and seed like model=tiny, so the
trainer, vLLM and the megatron converter all read the same checkpoint. Head size 32 because vLLM's
CPU attention refuses smaller heads. docs/moe.md.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from rltrain.config.schema import TINY_MOE_HEAD_DIM, ModelConfig
from rltrain.models.tiny import DEFAULT_CACHE, publish_directory, write_seeded_model

FORMAT = 1  # bumped when the files change


def tiny_moe_config(cfg: ModelConfig, vocab_size: int, eos_token_id: int, pad_token_id: int, bos_token_id: int):
    """The transformers `Qwen3MoeConfig` of the tiny MoE described by `cfg` (its `moe` section for
    the experts)."""
    from transformers import Qwen3MoeConfig

    if cfg.hidden_size != cfg.num_heads * TINY_MOE_HEAD_DIM:
        raise ValueError(
            f"model.hidden_size={cfg.hidden_size} must be model.num_heads={cfg.num_heads} x {TINY_MOE_HEAD_DIM} for the tiny MoE "
            f"(head size {TINY_MOE_HEAD_DIM}: vLLM's CPU attention refuses smaller heads)"
        )
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,  # unused: every layer is sparse (decoder_sparse_step=1)
        moe_intermediate_size=cfg.moe.expert_intermediate_size,
        num_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.experts_per_token,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=TINY_MOE_HEAD_DIM,
        max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=cfg.attention_bias,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        torch_dtype="float32",  # stored in fp32 whatever the run's precision (rltrain.runtime.precision)
    )


def write_tiny_moe(cfg: ModelConfig, seed: int, directory: Path) -> None:
    """Write the tiny MoE of `cfg` drawn with `seed` (weights and tokenizer) into `directory`: the
    plain builder, for a cache entry or a test's own directory."""
    write_seeded_model(lambda **token_ids: tiny_moe_config(cfg, **token_ids), seed, directory)


def _spec_key(cfg: ModelConfig, seed: int) -> str:
    spec = {
        k: getattr(cfg, k)
        for k in (
            "hidden_size num_layers num_heads num_kv_heads intermediate_size "
            "tie_word_embeddings attention_bias max_position_embeddings"
        ).split()
    }
    spec.update(
        num_experts=cfg.moe.num_experts,
        experts_per_token=cfg.moe.experts_per_token,
        expert_intermediate_size=cfg.moe.expert_intermediate_size,
        seed=seed,
        format=FORMAT,
    )
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def build_tiny_moe_model_dir(cfg: ModelConfig, seed: int) -> Path:
    """Build (once) and return the Hugging Face directory of the tiny MoE for `cfg` and `seed`,
    written to a temporary sibling and renamed into place (rltrain.models.tiny.publish_directory)."""
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_CACHE / "models"
    target = cache / f"tiny-qwen3_moe-{_spec_key(cfg, seed)}"
    if (target / "config.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=cache))
    try:
        write_tiny_moe(cfg, seed, tmp)
        publish_directory(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
