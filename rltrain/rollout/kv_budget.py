"""The KV cache a CPU vLLM engine allocates: `kv_cache_gib` at most, and no more than its
`max_num_seqs` sequences of its longest length can fill.

vLLM's CPU build allocates (and zeroes) the whole budget when it builds an engine and holds it for
the engine's life; a small model given 1 GiB spends most of its start-up clearing memory it never
uses. The need is read from the model's config.json as vLLM reads a plain attention model's (its
per-token KV size and its length limit); where the config does not say it plainly (scaled rotary
lengths, non-attention layers) the budget applies unchanged. docs/time-sharing-and-sync.md, "vLLM on CUDA".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 1 << 30
# The config keys vLLM takes a model's length limit from (the smallest one present).
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "half": 2}  # anything else counts 4 bytes (float32): never too few


def kv_cache_bytes(model_dir: str | Path, budget_gib: float, max_num_seqs: int, max_model_len: int | None,
                   dtype: str) -> int:
    """The bytes a CPU engine's KV cache takes: the budget, or what the engine can fill if less."""
    budget = int(budget_gib * GIB)
    need = kv_bytes_needed(model_dir, max_num_seqs, max_model_len, dtype)
    return budget if need is None else min(budget, need)


def kv_bytes_needed(model_dir: str | Path, max_num_seqs: int, max_model_len: int | None, dtype: str) -> int | None:
    """KV bytes for `max_num_seqs` sequences of the engine's longest length, with one sequence of
    headroom for vLLM's rounding to whole blocks; None where the config does not say it plainly."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text: dict[str, Any] = config.get("text_config") or config
    length = max_model_len or _length_limit(text, config)
    per_token = _bytes_per_token(text, dtype)
    if length is None or per_token is None:
        return None
    return (max_num_seqs + 1) * length * per_token


def _length_limit(text: dict[str, Any], config: dict[str, Any]) -> int | None:
    if text.get("rope_scaling") or config.get("rope_scaling") or _rope_types(text.get("rope_parameters")) - {"default"}:
        return None  # a scaled rotary length: vLLM's limit is not the config's plain one
    limits = [text[k] for k in LENGTH_KEYS if isinstance(text.get(k), int) and text[k] > 0]
    return min(limits) if limits else None


def _rope_types(parameters: Any) -> set[str]:
    """The rotary types of transformers' `rope_parameters` (one dict, or one per layer type)."""
    if not isinstance(parameters, dict):
        return set()
    if "rope_type" in parameters or not all(isinstance(v, dict) for v in parameters.values()):
        return {str(parameters.get("rope_type", "default"))}
    return {str(v.get("rope_type", "default")) for v in parameters.values()}


def _bytes_per_token(text: dict[str, Any], dtype: str) -> int | None:
    if not set(text.get("layer_types") or ATTENTION_LAYERS) <= ATTENTION_LAYERS:
        return None  # linear-attention or state-space layers keep state of another shape
    layers, heads, hidden = text.get("num_hidden_layers"), text.get("num_attention_heads"), text.get("hidden_size")
    if not (isinstance(layers, int) and isinstance(heads, int) and heads > 0):
        return None
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not isinstance(head_dim, int):
        return None
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
