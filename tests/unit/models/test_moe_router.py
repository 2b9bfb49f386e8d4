"""A MoE's router terms (rltrain.models.moe.router_terms, docs/moe.md "Router losses and
metrics") against hand-computed values, and how the run resolves its coefficients."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.models import moe


def _info(aux: float = 0.0, z: float = 0.0) -> moe.MoEInfo:
    return moe.MoEInfo(num_experts=4, top_k=2, aux_loss_coef=aux, implementation="grouped_mm", z_loss_coef=z)


def test_load_imbalance_and_z_loss_over_real_tokens_only():
    # 2 layers, B=1 x T=3 tokens, the last one padding (its routing must not count)
    layer0 = torch.tensor([[5.0, 4.0, 0.0, 0.0], [5.0, 0.0, 4.0, 0.0], [0.0, 0.0, 9.0, 9.5]])  # experts {0,1}, {0,2}
    layer1 = torch.tensor([[0.0, 0.0, 1.0, 2.0], [1.0, 2.0, 0.0, 0.0], [9.0, 9.0, 0.0, 0.0]])  # {2,3}, {0,1}: balanced
    mask_BT = torch.tensor([[1, 1, 0]])
    terms = moe.router_terms(torch.nn.Module(), _info(z=1e-3), (layer0, layer1), mask_BT)
    # layer 0: expert 0 takes 2 of the 4 choices: share 1/2 x 4 experts = 2; layer 1: 1/4 x 4 = 1
    assert float(terms.load_imbalance) == pytest.approx(2.0)
    real = torch.stack([layer0[:2], layer1[:2]])
    assert terms.z_loss is not None
    assert float(terms.z_loss) == pytest.approx(float(real.logsumexp(-1).square().mean()))
    assert terms.aux_loss is None  # its coefficient is 0


def test_a_perfectly_balanced_router_scores_one():
    logits = torch.eye(4).repeat(2, 1) * 3 + torch.roll(torch.eye(4), 1, 1).repeat(2, 1)  # each expert chosen equally
    terms = moe.router_terms(torch.nn.Module(), _info(), (logits,), None)
    assert float(terms.load_imbalance) == pytest.approx(1.0)
    assert terms.z_loss is None


def test_the_load_balancing_loss_is_the_familys_own():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=16, hidden_size=8, intermediate_size=8, moe_intermediate_size=4, num_hidden_layers=1,
                            num_attention_heads=1, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config)
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    terms = moe.router_terms(model, _info(aux=0.01), (logits,), None)
    probs = logits.softmax(-1)
    chosen = torch.zeros(6, 4).scatter_(1, probs.topk(2).indices, 1.0)
    expected = 4 * (chosen.mean(0) * probs.mean(0)).sum()  # Switch Transformer: E x sum_e f_e P_e (f over top-k)
    assert terms.aux_loss is not None and math.isclose(float(terms.aux_loss), float(expected), rel_tol=1e-5)


def test_coefficients_resolve_per_algorithm_kind():
    assert moe.router_losses(None, 0.0, generates=True) == moe.RouterLosses(0.0, 0.0)  # RL: off unless set
    assert moe.router_losses(None, 1e-3, generates=False) == moe.RouterLosses(None, 1e-3)  # the checkpoint's own
    assert moe.router_losses(0.02, 0.0, generates=True) == moe.RouterLosses(0.02, 0.0)
