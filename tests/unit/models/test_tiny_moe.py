"""The tiny MoE (model=tiny_moe) and the MoE families rltrain loads by `model.path` (docs/moe.md)."""

from __future__ import annotations

import pytest
import torch
from moe_families import FAMILIES, build_family_dir

from rltrain.config.schema import ModelConfig, MoEConfig
from rltrain.models import moe
from rltrain.models.tiny_moe import build_tiny_moe_model_dir

SMALL = dict(arch="qwen3_moe", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, attention_bias=False)


def test_tiny_moe_is_deterministic_cached_and_sparse(tiny_cache):
    from transformers import AutoModelForCausalLM

    cache = str(tiny_cache / "models")
    cfg = ModelConfig(**SMALL, moe=MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate_size=32), cache_dir=cache)
    d1 = build_tiny_moe_model_dir(cfg, seed=5)
    assert build_tiny_moe_model_dir(cfg, seed=5) == d1
    d2 = build_tiny_moe_model_dir(cfg, seed=6)
    assert d2 != d1
    m1 = AutoModelForCausalLM.from_pretrained(d1)
    assert m1.config.model_type == "qwen3_moe"
    assert (m1.config.num_experts, m1.config.num_experts_per_tok, m1.config.head_dim) == (4, 2, 32)
    assert moe.num_experts(m1.config) == 4
    w1 = m1.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(w1, AutoModelForCausalLM.from_pretrained(d2).model.layers[0].mlp.experts.gate_up_proj)
    fewer = ModelConfig(**SMALL, moe=MoEConfig(num_experts=2, experts_per_token=1, expert_intermediate_size=32), cache_dir=cache)
    assert build_tiny_moe_model_dir(fewer, seed=5) != d1  # the experts are part of the cache key


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_loads_and_exports_its_checkpoint(family, tiny_cache):
    """rltrain loads the family (experts made routing-independent for FSDP2), and the weights it
    syncs are the checkpoint's own tensors under the checkpoint's own names."""
    from safetensors.torch import load_file

    from rltrain.models.hf_io import load_causal_lm

    model_dir = build_family_dir(family, tiny_cache / "moe_families" / family)
    lm = load_causal_lm(model_dir, torch.float32)
    info = moe.prepare_moe(lm)
    assert info is not None and (info.num_experts, info.top_k) == (4, 2)
    exported = dict(moe.checkpoint_weights(lm, lm.state_dict().items()))
    on_disk = load_file(model_dir / "model.safetensors")
    assert exported.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_checkpoint_names_load_back_into_fused_experts(family, tiny_cache):
    """What the evaluation copy does with the synced weights: every tensor lands, experts included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = build_family_dir(family, tiny_cache / "moe_families" / family)
    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    missing, unexpected = moe.load_checkpoint_weights(fresh, dict(moe.checkpoint_weights(trained, trained.state_dict().items())))
    assert (missing, unexpected) == ([], [])
    for name, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "model, named",
    [
        (ModelConfig(**{**SMALL, "hidden_size": 96}), "must be model.num_heads=2 x 32"),
        (ModelConfig(**SMALL, moe=MoEConfig(num_experts=4, experts_per_token=5)), "model.moe.experts_per_token=5"),
        (ModelConfig(moe=MoEConfig(z_loss_coef=-1.0)), "model.moe.z_loss_coef=-1.0"),
    ],
)
def test_a_bad_moe_setting_is_refused_in_one_paragraph(model, named):
    from rltrain.preflight.validate import validate_model
    from rltrain.runtime.errors import UserError

    with pytest.raises(UserError, match=named.replace(".", r"\.").replace("(", r"\(")):
        validate_model(model)
