"""The embedded default model: a tiny Qwen2 (or Llama) built locally, deterministic from the seed.

With no `model.path`, a run builds this model and the character tokenizer, saves both as a normal
Hugging Face directory in a cache keyed by the architecture and the seed, and from then on loads
it like any checkpoint. Nothing is downloaded. Head size 32 is chosen because vLLM's CPU attention
refuses smaller heads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rltrain.config.schema import ModelConfig
from rltrain.models.tokenizer import build_char_tokenizer, padded_vocab_size

DEFAULT_CACHE = Path(os.environ.get("RLTRAIN_CACHE", Path.home() / ".cache" / "rltrain"))


def hf_config_for(cfg: ModelConfig, vocab_size: int, eos_token_id: int, pad_token_id: int, bos_token_id: int):
    """The transformers config of the tiny model described by `cfg`."""
    from transformers import LlamaConfig, Qwen2Config

    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"model.hidden_size={cfg.hidden_size} is not divisible by model.num_heads={cfg.num_heads}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        torch_dtype="float32",  # stored in fp32 whatever the run's precision (rltrain.runtime.precision)
    )
    if cfg.arch == "qwen2":
        config = Qwen2Config(**common)
        if not cfg.attention_bias:
            # transformers' Qwen2 always has q/k/v biases; a bias-free tiny model is a Llama.
            raise ValueError("model.attention_bias=false needs model.arch=llama (Qwen2 always has q/k/v biases)")
        return config
    if cfg.arch == "llama":
        return LlamaConfig(**common, attention_bias=cfg.attention_bias, mlp_bias=False)
    raise ValueError(f"model.arch={cfg.arch!r} is not a built-in tiny architecture; use qwen2 or llama")


def _spec_key(cfg: ModelConfig, seed: int) -> str:
    spec = {
        k: getattr(cfg, k)
        for k in (
            "arch hidden_size num_layers num_heads num_kv_heads intermediate_size "
            "tie_word_embeddings attention_bias max_position_embeddings"
        ).split()
    }
    spec["dtype"] = "float32"  # a fixed entry of the key, so the key every built cache has stays its key
    spec["seed"] = seed
    spec["format"] = 1
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def publish_directory(built: Path, target: Path) -> None:
    """Rename a fully written model directory into its cache place, atomically. Another process
    that built the same (content-keyed) directory first wins, which is fine."""
    try:
        built.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise


def write_seeded_model(config_for: Callable[..., Any], seed: int, directory: Path) -> None:
    """Save the character tokenizer and a model of the HF config `config_for(**token ids)` returns,
    its weights drawn from `seed`, into `directory`: every tiny model's one builder."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    hf_config = config_for(
        vocab_size=padded_vocab_size(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    fork_devices: list = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def build_tiny_model_dir(cfg: ModelConfig, seed: int) -> Path:
    """Build (once) and return the Hugging Face directory of the tiny model for `cfg` and `seed`.

    The directory is written to a temporary sibling and renamed into place, so concurrent ranks or
    runs never see a half-written model.
    """
    cache = Path(cfg.cache_dir) if cfg.cache_dir else DEFAULT_CACHE / "models"
    target = cache / f"tiny-{cfg.arch}-{_spec_key(cfg, seed)}"
    if (target / "config.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=cache))
    try:
        write_seeded_model(lambda **token_ids: hf_config_for(cfg, **token_ids), seed, tmp)
        publish_directory(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

