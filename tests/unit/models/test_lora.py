"""LoRA adapters (rltrain.models.lora) in one process: the merge equals peft's own, the initial
adapters leave the model unchanged and do not depend on the rank count, the adapter directory
loads with `PeftModel.from_pretrained`, and bad `model.lora` settings are refused before anything
is built. The engine on 1 and 2 ranks: tests/dist/backends/test_lora_engine.py; whole runs:
tests/e2e/test_cli_lora.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import compose_config

from rltrain.config.schema import LoraAdapterConfig, ModelConfig
from rltrain.models import lora
from rltrain.preflight.validate import validate
from rltrain.runtime.errors import UserError

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def base_dir(tiny_cache):
    from rltrain.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(SMALL, seed=5)


def _adapted(base_dir, settings: LoraAdapterConfig, seed: int = 0):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    adapters = lora.add_adapters(lm, settings)
    lora.fill_adapters(lm, seed)
    return lm, adapters


def _perturb(lm) -> None:
    """Non-zero B matrices, as after some training."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def test_every_decoder_linear_is_adapted_and_only_the_adapters_train(base_dir):
    lm, _ = _adapted(base_dir, LoraAdapterConfig(rank=4))
    trainable = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    adapted = {n.split(".")[-4] for n in trainable}  # ...<proj>.lora_A.default.weight
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head" in n or "embed" in n for n in trainable)
    lm_qv, _ = _adapted(base_dir, LoraAdapterConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    assert {n.split(".")[-4] for n, p in lm_qv.named_parameters() if p.requires_grad} == {"q_proj", "v_proj"}


def test_initial_adapters_leave_the_model_unchanged_and_are_a_function_of_the_seed(base_dir):
    from transformers import AutoModelForCausalLM

    lm, _ = _adapted(base_dir, LoraAdapterConfig(rank=4), seed=3)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    ids = torch.tensor([[3, 10, 11, 12, 7]])
    torch.testing.assert_close(lm(ids).logits, base(ids).logits, rtol=0, atol=0)
    first, again, other = (lora.initial_adapters(lm, s) for s in (3, 3, 4))
    assert first.keys() == again.keys() and len(first) == 2 * 7 * SMALL.num_layers
    for name, value in first.items():
        torch.testing.assert_close(value, again[name], rtol=0, atol=0)
        if ".lora_B." in name:
            assert not value.any()
        else:  # Kaiming-uniform: within 1/sqrt(fan_in), and seeded
            assert float(value.abs().max()) <= 1 / value.shape[1] ** 0.5
            assert not torch.equal(value, other[name])


def test_merged_weights_equal_peft_merge_under_the_base_names(base_dir):
    from transformers import AutoModelForCausalLM

    lm, adapters = _adapted(base_dir, LoraAdapterConfig(rank=4, alpha=8))
    _perturb(lm)
    merged = dict(lora.merged_weights(lm, gather=lambda t: t))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).state_dict()
    assert set(merged) == set(base)
    without = dict(lora.merged_weights(lm, gather=lambda t: t, with_adapters=False))
    for name, value in without.items():
        torch.testing.assert_close(value, base[name], rtol=0, atol=0)
    by_peft = adapters.merge_and_unload().state_dict()
    changed = 0
    for name, value in merged.items():
        torch.testing.assert_close(value, by_peft[name], rtol=0, atol=1e-6)
        changed += not torch.equal(value, base[name])
    assert changed == 7 * SMALL.num_layers  # every adapted weight, nothing else


def test_the_adapter_directory_loads_onto_the_base_with_peft(base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lm, adapters = _adapted(base_dir, LoraAdapterConfig(rank=4))
    _perturb(lm)
    lora.save_adapter_dir(adapters, tmp_path, lora.adapter_state(lm, gather=lambda t: t), base_dir)
    assert lora.is_adapter_dir(tmp_path) and not lora.is_adapter_dir(base_dir)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(base_dir)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), str(tmp_path))
    ids = torch.tensor([[3, 10, 11, 12, 7]])
    torch.testing.assert_close(loaded(ids).logits, lm(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.rank=-1"], "model.lora.rank=-1 must be 0"),
        (["model.lora.rank=8", "backend=megatron"], "trained on the FSDP backend only"),
        (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha=0 must be positive"),
        (["model.lora.rank=8", "model.lora.dropout=1.0"], "model.lora.dropout=1.0 must be in [0, 1)"),
        (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
        (["model.lora.rank=8", "model.lora.target_modules=[q_proj,lm_head]"], "lm_head cannot take an adapter"),
        (["safety.max_logprob_diff=-1"], "safety.max_logprob_diff=-1.0 must be a positive limit"),
    ],
)
def test_bad_lora_settings_are_refused_before_anything_is_built(overrides, message):
    with pytest.raises(UserError) as err:
        validate(compose_config(*overrides))
    assert message in str(err.value)


def test_an_adapter_directory_given_as_a_model_says_where_the_merged_model_is(base_dir, tmp_path):
    lm, adapters = _adapted(base_dir, LoraAdapterConfig(rank=4))
    lora.save_adapter_dir(adapters, tmp_path, lora.adapter_state(lm, gather=lambda t: t), base_dir)
    with pytest.raises(UserError) as err:
        validate(compose_config(f"model.path={tmp_path}"))
    assert "is a PEFT adapter directory" in str(err.value) and "final/merged/" in str(err.value)
