"""rltrain/rollout/kv_budget.py: a CPU engine's KV cache is its budget, or what its sequences can
fill if less; the budget whenever the config does not say plainly what they need."""

from __future__ import annotations

import json

import pytest

from rltrain.rollout.kv_budget import GIB, kv_bytes_needed, kv_cache_bytes

LLAMA = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 64,
         "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}


def model_dir(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_need_is_every_sequence_of_the_longest_length_and_one_more(tmp_path):
    # 2 (k and v) x 2 layers x 1 kv head x 32 dims x 4 bytes = 512 bytes a token; 17 x 512 tokens.
    assert kv_bytes_needed(model_dir(tmp_path, LLAMA), 16, None, "float32") == 17 * 512 * 512
    assert kv_bytes_needed(tmp_path, 16, 128, "bfloat16") == 17 * 128 * 256  # rollout.max_model_len, 2 bytes
    assert kv_bytes_needed(model_dir(tmp_path, {**LLAMA, "head_dim": 16}), 1, 10, "float32") == 2 * 10 * 256
    smallest = {**LLAMA, "seq_length": 300, "max_position_embeddings": 4096}
    assert kv_bytes_needed(model_dir(tmp_path, smallest), 1, None, "float32") == 2 * 300 * 512


def test_a_vision_language_models_text_config_is_read(tmp_path):
    assert kv_bytes_needed(model_dir(tmp_path, {"text_config": LLAMA, "vision_config": {}}), 1, 8, "float32") == 2 * 8 * 512


@pytest.mark.parametrize("change", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
    {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}, "sliding_attention": {"rope_type": "default"}}},
    {"layer_types": ["full_attention", "linear_attention"]},
    {"num_attention_heads": None},
    {"max_position_embeddings": None},
], ids=["rope_scaling", "yarn", "per-layer-rope", "linear-attention", "no-heads", "no-length"])
def test_where_the_config_is_not_plain_the_budget_applies(tmp_path, change):
    directory = model_dir(tmp_path, {**LLAMA, **change})
    assert kv_bytes_needed(directory, 16, None, "float32") is None
    assert kv_cache_bytes(directory, 1.0, 16, None, "float32") == GIB


def test_the_budget_is_the_most_and_a_missing_config_keeps_it(tmp_path):
    directory = model_dir(tmp_path, LLAMA)
    assert kv_cache_bytes(directory, 1.0, 16, None, "float32") == 17 * 512 * 512
    assert kv_cache_bytes(directory, 0.001, 16, None, "float32") == int(0.001 * GIB)
    assert kv_cache_bytes(tmp_path / "missing", 0.5, 16, None, "float32") == GIB // 2
