"""Sharded start-up: only rank 0 reads the checkpoint and no other rank holds the full model, yet
every rank ends with rank 0's weights, ties and non-persistent buffers (rotary inv_freq) right."""

import pytest
import torch

from helpers import run_ranks

pytestmark = pytest.mark.dist


def _load_and_report(rank, world, model_dir):
    from transformers import AutoModelForCausalLM

    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig

    reads = {"n": 0}
    real = AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *a, **k):
        reads["n"] += 1
        return real(cls, *a, **k)

    AutoModelForCausalLM.from_pretrained = classmethod(counting)
    eng = FSDPEngine(model_dir, FSDPBackendConfig(), OptimConfig(), 10, torch.device("cpu"))
    AutoModelForCausalLM.from_pretrained = classmethod(real)
    lm = eng.lm
    local_numel = sum(p.to_local().numel() for p in lm.parameters())
    full = {k: v.clone() for k, v in eng.export_weights()}  # full tensors (all-gathered)
    return {
        "reads": reads["n"],
        "local_numel": local_numel,
        "full_numel": sum(v.numel() for v in full.values()),
        "checksum": {k: float(v.double().sum()) for k, v in full.items()},
        "inv_freq": lm.model.rotary_emb.inv_freq.clone(),
        "original_inv_freq": lm.model.rotary_emb.original_inv_freq.clone(),
        "tied": lm.lm_head.weight is lm.model.embed_tokens.weight,
        "meta": [n for n, t in list(lm.named_parameters()) + list(lm.named_buffers()) if t.is_meta],
    }


@pytest.mark.parametrize("tied", [True, False])
def test_rank0_reads_and_each_rank_receives_its_shards(tiny_cache, tied):
    from transformers import AutoModelForCausalLM

    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, tie_word_embeddings=tied)
    model_dir = build_tiny_model_dir(cfg, seed=1)
    r0, r1 = run_ranks(_load_and_report, model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    expected = {k: v for k, v in reference.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(r1["checksum"]) == set(expected)
    for key, value in expected.items():
        assert r1["checksum"][key] == pytest.approx(float(value.double().sum()), abs=0, rel=0), key
        assert r0["checksum"][key] == r1["checksum"][key]
    rotary = reference.model.rotary_emb
    for r in (r0, r1):
        torch.testing.assert_close(r["inv_freq"], rotary.inv_freq, rtol=0, atol=0)
        torch.testing.assert_close(r["original_inv_freq"], rotary.original_inv_freq, rtol=0, atol=0)
        assert r["tied"] == tied
        assert r["meta"] == []
        # each rank stores about half the parameters (uneven dims round up), never the whole model
        assert r["local_numel"] <= r["full_numel"] / 2 + 4096
    assert (r0["reads"], r1["reads"]) == (1, 0)  # only rank 0 read the checkpoint
