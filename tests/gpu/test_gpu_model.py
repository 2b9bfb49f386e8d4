"""A 0.5B-class Hugging Face model (the Qwen2.5-0.5B shape: hidden 896, 24 layers, 14/2 heads,
vocabulary 151,936, tied embeddings), built locally with random weights, trained through
`model.path` in the default precision (`auto` = `bf16-mixed` on CUDA). Marked `gpu`."""

from __future__ import annotations

import math

import pytest
import torch
from cli import rltrain, train_rows

pytestmark = pytest.mark.gpu


def build_qwen2_half_b(directory) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltrain.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_half_billion_model_trains_in_bf16_mixed(backend, tmp_path_factory, tmp_path):
    model_dir = tmp_path_factory.getbasetemp() / "qwen2-0.5b"
    if not (model_dir / "config.json").exists():
        build_qwen2_half_b(model_dir)
    rltrain(
        "algo=sft", f"backend={backend}", f"model.path={model_dir}", "trainer.max_steps=8", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "optim.lr=1e-4",
        "optim.warmup_steps=2", "logger.wandb.mode=disabled", "trainer.progress=lines",
        run_dir=tmp_path / "run", timeout=600,
    )
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 8 and all(math.isfinite(r["loss"]) and r["safety/recovered_errors"] == 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
