"""Rank 0 reads the checkpoint; the others receive it in a few buckets, with ties and buffers right."""

import os

import pytest
import torch

from helpers import run_ranks

pytestmark = pytest.mark.dist


def _load_and_report(rank, world, model_dir, tied):
    import torch.distributed as dist

    from rltrain.models import hf_io

    calls = {"n": 0}
    real_broadcast = dist.broadcast

    def counting_broadcast(*a, **k):
        calls["n"] += 1
        return real_broadcast(*a, **k)

    hf_io.dist.broadcast = counting_broadcast
    model = hf_io.load_causal_lm(model_dir, torch.float32, bucket_mb=1)
    hf_io.dist.broadcast = real_broadcast
    state = {k: v.clone() for k, v in model.state_dict().items()}
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    return {
        "collectives": calls["n"],
        "num_tensors": len(state),
        "checksum": {k: float(v.double().sum()) for k, v in state.items()},
        "inv_freq": inv_freq,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


@pytest.mark.parametrize("tied", [True, False])
def test_rank0_loads_and_broadcasts_in_buckets(tiny_cache, tied):
    from transformers import AutoModelForCausalLM

    from rltrain.config import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, tie_word_embeddings=tied)
    model_dir = build_tiny_model_dir(cfg, seed=1)
    os.environ["RLTRAIN_CACHE"] = str(tiny_cache)
    r0, r1 = run_ranks(_load_and_report, model_dir, tied)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    for key, value in reference.state_dict().items():
        assert r1["checksum"][key] == pytest.approx(float(value.double().sum()), abs=0, rel=0), key
        assert r0["checksum"][key] == r1["checksum"][key]
    torch.testing.assert_close(r1["inv_freq"], reference.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert r1["tied"] == tied and r0["tied"] == tied
    # batched: far fewer collectives than tensors (1 MB buckets, ~0.5M params)
    assert r1["collectives"] < r1["num_tensors"] / 4
