"""The critic's pure pieces: the seeded value head, fp32 values, what each role is built from,
the refusal message, and the megatron conversion table's view of the head."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rltrain.backends.base import scored_output, wrong_scores_error
from rltrain.backends.megatron.convert import (
    OUTPUT,
    VALUE_HEAD_BIAS,
    VALUE_HEAD_WEIGHT,
    split_dim,
    stage_param_names,
)
from rltrain.backends.megatron.spec import ModelSpec
from rltrain.backends.roles import role_build
from rltrain.backends.value_head import head_values, initial_value_head, new_value_head
from rltrain.data.ragged import Ragged


def test_initial_head_is_a_pure_function_of_size_and_seed() -> None:
    a, b, other = initial_value_head(64, 3), initial_value_head(64, 3), initial_value_head(64, 4)
    assert torch.equal(a["weight"], b["weight"]) and torch.equal(a["bias"], b["bias"])
    assert not torch.equal(a["weight"], other["weight"])
    assert a["weight"].shape == (1, 64) and a["weight"].dtype == torch.float32
    assert float(a["weight"].abs().sum()) > 0  # not a zero head: values depend on the hidden states
    before = torch.get_rng_state()
    initial_value_head(64, 3)
    assert torch.equal(before, torch.get_rng_state()), "the head's draw must not move the global RNG"


def test_values_are_fp32_from_bf16_weights_and_under_autocast() -> None:
    head = new_value_head(8, 0, torch.bfloat16)
    hidden_NH = torch.randn(5, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values_N = head_values(head, hidden_NH)
    assert values_N.dtype == torch.float32 and values_N.shape == (5,)
    expected_N = hidden_NH.float() @ head.weight.float()[0] + head.bias.float()
    torch.testing.assert_close(values_N, expected_N, rtol=0, atol=0)
    assert new_value_head(8, 0, torch.float32, "meta").weight.is_meta


def test_scored_output_puts_values_where_a_critic_reads_them() -> None:
    r = Ragged.from_lengths(torch.arange(3.0), [1, 2])
    critic = scored_output("values", r)
    assert critic.values is r and critic.logps is None
    policy = scored_output("logps", r)
    assert policy.logps is r and policy.values is None


def test_wrong_scores_errors_name_what_to_call() -> None:
    assert "call forward_values" in str(wrong_scores_error("FSDPEngine", "values", "forward_logps"))
    msg = str(wrong_scores_error("MegatronEngine", "logps", "forward_values"))
    assert "MegatronEngine.forward_values" in msg and "build_engine(ctx, 'critic')" in msg


def _ctx(tmp_path: Path, algo: str = "ppo", lora_rank: int = 4) -> SimpleNamespace:
    cfg = OmegaConf.create(
        {"optim": {"lr": 0.5, "eps": 1e-6}, "critic": {"path": None, "lr": 1e-5}, "trainer": {"seed": 7},
         "model": {"lora": {"rank": lora_rank}}, "algo": {"name": algo}}
    )
    dirs = {"critic": tmp_path / "critic"}
    return SimpleNamespace(cfg=cfg, model_dir_for=lambda role: dirs.get(role, tmp_path / "policy"))


def test_roles_are_built_from_their_own_settings(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    critic = role_build(ctx, "critic")
    assert critic.model_dir == tmp_path / "critic" and critic.value_head_seed == 7
    assert critic.optim.lr == 1e-5 and critic.optim.eps == 1e-6  # critic.lr, the rest from optim
    assert ctx.cfg.optim.lr == 0.5, "the policy's optimizer settings must not change"
    policy = role_build(ctx, "policy")
    assert policy.optim.lr == 0.5 and policy.value_head_seed is None and policy.model_dir == tmp_path / "policy"
    assert policy.adapters.rank == 4 and critic.adapters is None  # LoRA is the policy's alone
    reference = role_build(ctx, "reference")
    assert reference.optim is None and reference.value_head_seed is None and reference.adapters is None
    with pytest.raises(ValueError, match="unknown"):
        role_build(ctx, "judge")
    assert critic.value_head_bias and policy.value_head_bias


def test_a_reward_model_is_the_policy_with_a_bias_free_scalar_head(tmp_path: Path) -> None:
    """algo=rm: the policy role gets `optim` (not `critic.lr`), a head seeded by `trainer.seed`
    and no bias, like a Hugging Face sequence classifier's score layer; `model.lora`'s adapters
    when its rank is positive (the head then trains beside them)."""
    policy = role_build(_ctx(tmp_path, algo="rm"), "policy")
    assert policy.value_head_seed == 7 and not policy.value_head_bias and policy.adapters.rank == 4
    assert role_build(_ctx(tmp_path, algo="rm", lora_rank=0), "policy").adapters is None
    assert policy.optim.lr == 0.5 and policy.model_dir == tmp_path / "policy"
    head = new_value_head(16, 7, torch.float32, bias=False)
    assert head.bias is None and torch.equal(head.weight, initial_value_head(16, 7)["weight"])
    hidden_NH = torch.randn(3, 16)
    assert torch.allclose(head_values(head, hidden_NH), hidden_NH @ head.weight[0])


def test_megatron_tables_treat_the_head_as_replicated_and_skip_the_output_layer() -> None:
    assert split_dim(VALUE_HEAD_WEIGHT) is None and split_dim(VALUE_HEAD_BIAS) is None
    spec = ModelSpec(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
        ffn_hidden_size=128, rms_eps=1e-6, rope_theta=1e4, max_positions=64, qkv_bias=True, tie_embeddings=False,
    )
    assert OUTPUT in stage_param_names(spec, 0, 1)
    assert OUTPUT not in stage_param_names(spec, 0, 1, output=False)
