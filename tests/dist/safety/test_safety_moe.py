"""A tiny Qwen3-MoE on 2 FSDP2 ranks whose routing differs per rank (rank 1 sees one short
sequence, so most experts get no token there) gives the same gradients as one process.

The ranks run transformers' `eager` experts loop, which rltrain replaces by the every-expert
loop, with non-reentrant gradient checkpointing and the load-balancing loss on; the reference is
one process with transformers' default experts implementation and no checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.dist

COEF = 0.05


def _build_moe_dir(path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=COEF, pad_token_id=0, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)  # decisive, token-dependent routing
    model.save_pretrained(path)
    return path


def _batches():
    from rltrain.data.batch import SequenceBatch

    g = torch.Generator().manual_seed(5)
    big = ([torch.randint(1, 48, (4 + i,), generator=g).tolist() for i in range(3)],
           [torch.randint(1, 48, (3 + i,), generator=g).tolist() for i in range(3)])
    small = ([[7]], [[9]])
    total = sum(map(len, big[1])) + 1
    return [SequenceBatch.from_lists(*big, global_tokens=total), SequenceBatch.from_lists(*small, global_tokens=total)]


def _rank(rank, world, model_dir):
    from rltrain.algos.sft import sft_loss
    from rltrain.backends.fsdp import engine as fsdp
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig
    from rltrain.models.moe import EVERY_EXPERT

    real_load = fsdp.load_causal_lm

    def load_eager(*args, **kwargs):
        model = real_load(*args, **kwargs)
        model.set_experts_implementation("eager")  # the routing-dependent loop rltrain must replace
        return model

    fsdp.load_causal_lm = load_eager
    engine = fsdp.FSDPEngine(model_dir, FSDPBackendConfig(), OptimConfig(warmup_steps=0, max_grad_norm=0.0), 1, torch.device("cpu"))
    engine.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grads = {}

    def capture(*_):
        for name, p in engine.scorer.named_parameters():
            grads[name] = p.grad.full_tensor().clone() if p.grad is not None else None

    engine.optimizer.register_step_pre_hook(capture)
    metrics = engine.train_step([_batches()[rank]], sft_loss)
    return {"grads": grads, "impl": engine.moe_info.implementation == EVERY_EXPERT, "aux": metrics["moe/aux_loss"]}


def _reference(model_dir):
    from rltrain.algos.sft import sft_loss
    from rltrain.backends.base import PolicyOutput
    from rltrain.backends.fsdp.hf_scoring import CompletionScorer, completion_positions
    from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle
    from rltrain.data.ragged import Ragged
    from rltrain.models.hf_io import load_causal_lm
    from rltrain.models.moe import prepare_moe

    lm = load_causal_lm(model_dir, torch.float32)
    info = prepare_moe(lm)
    assert info is not None and info.implementation != "eager"
    scorer = CompletionScorer(lm, info).train()
    aux_total = 0.0
    for mb in _batches():
        ids, mask = mb.tokens.to_padded(0)
        rows, cols, targets = completion_positions(mb)
        logps, _, router = scorer([Rectangle(ids, rows, cols)], targets, False, None, mask)
        aux = router.aux_loss
        loss, _ = sft_loss(PolicyOutput(Ragged.from_lengths(logps, mb.completion_lens())), mb)
        (loss + COEF * aux / 2).backward()
        aux_total += float(aux.detach()) / 2
    return {name: p.grad for name, p in scorer.named_parameters()}, aux_total


def test_moe_gradients_match_a_single_process_with_differing_routing(tiny_cache, tmp_path):
    model_dir = _build_moe_dir(tmp_path / "moe")
    r0, r1 = run_ranks(_rank, model_dir, timeout_s=150, pg_timeout_s=30)
    assert r0["impl"] and r1["impl"]
    ref, aux = _reference(model_dir)
    assert r0["aux"] == pytest.approx(aux, rel=1e-5)
    for name, g_ref in ref.items():
        assert r0["grads"][name] is not None, name
        torch.testing.assert_close(r0["grads"][name], g_ref, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(r1["grads"][name], r0["grads"][name], rtol=0, atol=0, msg=name)


def test_router_logits_only_for_real_moe_models():
    from transformers import Qwen2Config, Qwen3MoeConfig

    from rltrain.models.moe import is_moe

    dense = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    dense.output_router_logits = True  # a dense config carrying the key must still not ask
    assert not is_moe(dense)
    assert is_moe(Qwen3MoeConfig(num_experts=4))
    assert not is_moe(Qwen3MoeConfig(num_experts=1))


def test_every_expert_loop_matches_transformers_and_runs_every_expert(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    from rltrain.models import moe

    model_dir = _build_moe_dir(tmp_path / "moe")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[3, 5, 7]])
    expected = model.model(input_ids=ids).last_hidden_state
    model.set_experts_implementation("eager")
    calls: list[int] = []
    real_where = torch.where

    def counting_where(*args):
        out = real_where(*args)
        if len(args) == 1:
            calls.append(int(out[0].numel()))
        return out

    info = moe.prepare_moe(model)
    assert info is not None and info.implementation == moe.EVERY_EXPERT and info.aux_loss_coef == COEF
    monkeypatch.setattr(moe.torch, "where", counting_where)
    got = model.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert len(calls) == 2 * 8 and 0 in calls  # every expert of both layers ran, some on no tokens
