"""DPO over ragged batches equals a plain single-process computation (within 1e-5).

The reference computation scores each sequence alone, unpadded, with a plain transformers model:
no micro-batching, no ranks, no packing. The engine path must agree for every split: micro-batch
1 vs 4 (gradient accumulation), 1 vs 2 ranks with an odd number of pairs, pairs whose lengths
differ by more than 10x, and a batch of a single pair (so one rank holds no pair at all).
"""

from __future__ import annotations

import pytest
import torch

from helpers import run_ranks

pytestmark = pytest.mark.dist

BETA, SFT_WEIGHT = 0.5, 0.3


def _model_dirs():
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=11), build_tiny_model_dir(cfg, seed=12)


def _pairs(kind: str, tokenizer):
    from rltrain.data.preference_data import PreferencePair

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    eos = tokenizer.eos_token_id
    if kind == "wide":  # rejected more than 10x longer than chosen
        return [PreferencePair(enc(f"{a}+1="), enc(str(a + 1)[:1]) + [eos], enc("9" * (30 + a)) + [eos]) for a in range(4)]
    count = {"one": 1, "odd": 7, "eight": 8}[kind]
    return [
        PreferencePair(enc(f"{a}+{a * 3}="), enc(str(4 * a)) + [eos], enc(str(4 * a + 7) * (1 + a % 3)) + [eos])
        for a in range(count)
    ]


def _engine_step(rank, world, policy_dir, ref_dir, kind, micro_batch_size, backend="fsdp"):
    from rltrain.models.tokenizer import load_tokenizer

    from rltrain.algos.dpo import attach_reference, dpo_micro_batches, make_dpo_loss
    from rltrain.backends.fsdp.engine import FSDPEngine
    from rltrain.config.group_options import FSDPBackendConfig
    from rltrain.config.schema import OptimConfig

    torch.set_num_threads(1)
    tok = load_tokenizer(policy_dir)
    pairs = _pairs(kind, tok)
    cpu = torch.device("cpu")
    optim = OptimConfig(max_grad_norm=0.0)
    if backend == "megatron-pp2":
        from rltrain.backends.megatron.engine import MegatronEngine
        from rltrain.config.group_options import MegatronBackendConfig

        policy = MegatronEngine(policy_dir, MegatronBackendConfig(tp=1, pp=2), optim, 10, cpu)
        reference = MegatronEngine(ref_dir, MegatronBackendConfig(tp=1, pp=2), None, 10, cpu, groups=policy.groups)
    else:
        policy = FSDPEngine(policy_dir, FSDPBackendConfig(), optim, 10, cpu)
        reference = FSDPEngine(ref_dir, FSDPBackendConfig(), None, 10, cpu)
    # Slicing follows the engine's data-parallel rank/size (pipeline stages share the data).
    rank, world = policy.rank, policy.world_size
    micro, _ = dpo_micro_batches(pairs, rank, world, micro_batch_size)
    attach_reference(micro, reference)
    metrics = policy.train_step(micro, make_dpo_loss(BETA, "sigmoid", 0.0, SFT_WEIGHT))
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "accuracy": metrics["dpo/accuracy"]}


def _plain_reference(policy_dir, ref_dir, kind):
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from rltrain.models.tokenizer import load_tokenizer

    tok = load_tokenizer(policy_dir)
    pairs = _pairs(kind, tok)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)

    def seq_logp(model, prompt, completion):
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        token_logps = logp.gather(-1, ids[0, 1:, None])[:, 0]
        return token_logps[len(prompt) - 1 :].sum()

    losses, chosen_sum, wins = [], 0.0, 0
    for p in pairs:
        pc, pr = seq_logp(policy, p.prompt, p.chosen), seq_logp(policy, p.prompt, p.rejected)
        with torch.no_grad():
            rc, rr = seq_logp(ref, p.prompt, p.chosen), seq_logp(ref, p.prompt, p.rejected)
        losses.append(-F.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
        chosen_sum = chosen_sum + pc
        wins += int(BETA * (pc - rc) > BETA * (pr - rr))
    n_chosen_tokens = sum(len(p.chosen) for p in pairs)
    loss = torch.stack(losses).mean() + SFT_WEIGHT * (-chosen_sum / n_chosen_tokens)
    loss.backward()
    grad_norm = torch.norm(torch.stack([p.grad.norm() for p in policy.parameters() if p.grad is not None]))
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "accuracy": wins / len(pairs)}


@pytest.mark.parametrize(
    "kind, nproc, micro_batch_size",
    [
        ("eight", 1, 1),  # (a) micro-batch 1: 8 accumulation steps
        ("eight", 1, 4),  # (a) micro-batch 4: 2 accumulation steps
        ("odd", 2, 2),  # (b) 7 pairs over 2 ranks
        ("wide", 2, 1),  # (c) lengths differing > 10x
        ("one", 2, 4),  # (d) a single pair: rank 1 holds none
    ],
)
def test_dpo_step_equals_plain_single_process_computation(tiny_cache, kind, nproc, micro_batch_size):
    policy_dir, ref_dir = _model_dirs()
    expected = _plain_reference(policy_dir, ref_dir, kind)
    results = run_ranks(_engine_step, policy_dir, ref_dir, kind, micro_batch_size, nproc=nproc, timeout_s=240)
    for got in results:
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        assert got["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-9)


def test_dpo_on_megatron_pipeline_parallel_2_equals_plain_computation(tiny_cache):
    """(e) Two pipeline stages, micro-batches of different lengths (one pair each, lengths vary)."""
    policy_dir, ref_dir = _model_dirs()
    expected = _plain_reference(policy_dir, ref_dir, "eight")
    results = run_ranks(_engine_step, policy_dir, ref_dir, "eight", 1, "megatron-pp2", nproc=2, timeout_s=300)
    for got in results:
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
