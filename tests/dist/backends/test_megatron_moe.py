"""Expert parallelism on megatron (docs/moe.md, "Expert parallelism (megatron)"), on 2 gloo ranks.

A tiny Qwen3-MoE (8 experts, top-2, every weight random so that routing has no ties) runs through
`MegatronEngine` at each (tp, pp, ep) of `LAYOUTS` in the same 2 ranks, one after the other, on the
same global batches. Each run checks itself against Hugging Face (logits of the converted model, and
the export of its weights back to HF names, bitwise); every run must then give the losses, gradient
norms and gradients (exported under HF names, so every expert is compared wherever it lives) of
the first (tp = pp = ep = 1) over 5 SFT steps and (`GRPO_LAYOUTS`) 5 GRPO steps, and the checkpoint and
`save_pretrained` paths must cover every expert.

A tiny Qwen2-MoE (a shared expert, q/k/v biases) is checked against Hugging Face's logits and SFT
gradients at ep=2 with and without tp=2, and a tiny Mixtral at tp=2 ep=2, in the same ranks.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from helpers import portable, ragged_micro_batches, run_ranks

from rltrain.data.batch import SequenceBatch
from rltrain.models.moe import RouterLosses

pytestmark = pytest.mark.dist

VOCAB, STEPS, PROMPTS, GROUP = 96, 5, 2, 4
# (tp, pp, ep) on 2 ranks: 2 data-parallel replicas without and with expert parallelism; one replica
# of 2 TP ranks whose experts are whole on each rank, or split over the two; 2 pipeline stages
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 1)]
GRPO_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2)]  # the others add nothing to GRPO that SFT does not show
ROUTER_COEFS = (0.1, 0.01)  # model.moe.aux_loss_coef, model.moe.z_loss_coef (large enough to move the gradients)
OPTIM = dict(lr=1e-2, weight_decay=0.01, beta1=0.9, beta2=0.98, eps=1e-4, warmup_steps=0, schedule="constant", max_grad_norm=1.0)


def qwen3_moe_dir(path: Path, experts: int = 8, topk: int = 2, norm_topk_prob: bool = True) -> Path:
    """A tiny Qwen3-MoE saved as a HF directory, every weight random (norms near one)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=experts, num_experts_per_tok=topk,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * 0.15 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def qwen2_moe_dir(path: Path) -> Path:
    """A tiny Qwen2-MoE (q/k/v biases, a sigmoid-gated shared expert, top-k not renormalised)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * 0.15 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def mixtral_dir(path: Path) -> Path:
    """A tiny Mixtral (block_sparse_moe, experts' w1/w3/w2)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * 0.15 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def _hf_sft_grads(model_dir: Path, router: tuple[float, float] | None = None) -> dict[str, torch.Tensor]:
    """The SFT loss's gradient over both ranks' batches under checkpoint names (experts split).
    `router` = (aux, z) coefficients: plus the router losses as the FSDP engine adds them, each
    micro-batch's (`rltrain.models.moe.router_terms` over its padded rows) weighted by 1 / micro-batches;
    their mean values then ride in the result under "moe/aux_loss", "moe/z_loss", "moe/load_imbalance"."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rltrain.models import moe

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batches = ragged_micro_batches(0, VOCAB) + ragged_micro_batches(1, VOCAB)
    n_tokens = sum(b.num_completion_tokens for b in batches)
    loss = torch.zeros(())
    for mb in batches:
        for seq, p in zip(mb.tokens.split(), mb.prompt_lens.tolist()):
            logp_TV = torch.log_softmax(model(seq[None]).logits[0], -1)[p - 1 : -1]
            loss = loss - logp_TV.gather(-1, seq[p:, None]).sum() / n_tokens
    means: dict[str, torch.Tensor] = {}
    if router is not None:
        info = moe.MoEInfo(moe.num_experts(model.config), model.config.num_experts_per_tok, router[0], "eager", router[1])
        for mb in batches:
            tokens_BT, mask_BT = mb.tokens.to_padded(pad_value=0)
            out = model(input_ids=tokens_BT.long(), attention_mask=mask_BT.long(), output_router_logits=True)
            terms = moe.router_terms(model, info, out.router_logits, mask_BT)
            loss = loss + (router[0] * terms.aux_loss + router[1] * terms.z_loss) / len(batches)
            for key, value in (("aux_loss", terms.aux_loss), ("z_loss", terms.z_loss), ("load_imbalance", terms.load_imbalance)):
                means[f"moe/{key}"] = means.get(f"moe/{key}", 0.0) + value.detach() / len(batches)
    loss.backward()
    # transformers fuses a layer's experts ([E, 2I, H] and [E, H, I]); the checkpoint names each
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118 - safe_open handles are not iterable
    mixtral = any(".w1." in n for n in names)
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if mixtral else "mlp"
    grads = {}
    for name, param in model.named_parameters():
        hf = name.replace(".mlp.", f".{block}.")
        if name.endswith("experts.gate_up_proj"):
            gate_EIH, up_EIH = param.grad.chunk(2, dim=1)
            for e in range(param.shape[0]):
                grads[hf.replace("gate_up_proj", f"{e}.{gate}.weight")] = gate_EIH[e]
                grads[hf.replace("gate_up_proj", f"{e}.{up}.weight")] = up_EIH[e]
        elif name.endswith("experts.down_proj"):
            for e in range(param.shape[0]):
                grads[hf.replace("down_proj", f"{e}.{down}.weight")] = param.grad[e]
        else:
            grads[hf if "experts" in name or name.endswith("mlp.gate.weight") else name] = param.grad
    assert set(grads) == set(names), sorted(set(grads) ^ set(names))[:4]
    return {**grads, **means}


def _hf_logits(model_dir: Path, batches: list[list[SequenceBatch]]) -> list[list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [[model(seq[None]).logits[0] for mb in rank_data for seq in mb.tokens.split()] for rank_data in batches]


# -- the worker -------------------------------------------------------------------------------


def _grads_under_hf_names(eng) -> dict[str, torch.Tensor]:
    """The gradients about to be stepped, exported like weights (every expert on every rank)."""
    weights = [p.data for p in eng.params]
    try:
        for p in eng.params:
            p.data = p.grad
        return {name: t.clone() for name, t in eng.export_weights()}
    finally:
        for p, w in zip(eng.params, weights):
            p.data = w


def _record_grads(eng, into: list) -> None:
    step = eng.optimizer.step

    def recording_step(*args, **kwargs):
        into.append(_grads_under_hf_names(eng))
        return step(*args, **kwargs)

    eng.optimizer.step = recording_step


def _logits(eng, batches: list[SequenceBatch]) -> list[torch.Tensor]:
    import torch.distributed as dist

    from rltrain.backends.megatron.model import stage_forward

    out = []
    with torch.no_grad():
        for mb in batches:
            for seq in mb.tokens.split():
                hidden_BTH = stage_forward(eng.model, seq[None], len(seq), None)
                shard_TV = (hidden_BTH @ eng.model.output_layer.weight.T)[0]
                shards = [shard_TV]
                if eng.coords.tp > 1:  # the output layer is split by vocabulary rows
                    shards = [torch.empty_like(shard_TV) for _ in range(eng.coords.tp)]
                    dist.all_gather(shards, shard_TV, group=eng.coords.tp_group)
                out.append(torch.cat(shards, dim=-1)[:, :VOCAB])
    return out


def _sft(eng, batches: list[SequenceBatch], n_tokens: int) -> list[dict]:
    def loss_fn(out, mb):
        return -out.logps.values.sum() / n_tokens, {}

    return [eng.train_step(batches, loss_fn) for _ in range(STEPS)]


def _completion(prompt: int, k: int, step: int) -> list[int]:
    return [(5 + prompt * 7 + k * 3 + step + i) % VOCAB for i in range(1 + (k * 3 + prompt + step) % 6)]


def _grpo(eng) -> list[dict]:
    """5 GRPO updates through the RL Learner, each on fresh completions and advantages."""
    from rltrain.algos.grpo import GRPOConfig
    from rltrain.algos.rl.batch_layout import BatchLayout
    from rltrain.algos.rl.experience import Experience
    from rltrain.algos.rl.update import Learner, MiniBatchUpdate, ParityProbe, make_policy_loss
    from rltrain.data.sharding import rank_slice
    from rltrain.rewards.scoring import Failures

    cfg = GRPOConfig(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=8)
    layout = BatchLayout(PROMPTS, GROUP, eng.rank, eng.world_size)
    parity = ParityProbe()
    learner = Learner(eng, MiniBatchUpdate(layout, 1, 1, 2, 0), make_policy_loss(cfg, parity), parity, True)
    mine = rank_slice(list(range(PROMPTS)), eng.rank, eng.world_size)
    metrics = []
    for step in range(STEPS):
        seqs = [(g, _completion(g, k, step)) for g in mine for k in range(GROUP)]
        batch = SequenceBatch.from_lists([[3 + g, 7, 4 + g + step] for g, _ in seqs], [c for _, c in seqs])
        engine_logps = eng.forward_logps([batch])[0].logps
        adv = torch.linspace(-1.0, 1.0, PROMPTS * GROUP).roll(step)[layout.offset : layout.offset + len(batch)]
        tokens = sum(len(_completion(g, k, step)) for g in range(PROMPTS) for k in range(GROUP))
        counts = torch.tensor([float(tokens), float(PROMPTS * GROUP), 0.0, float(tokens)], dtype=torch.float64)
        empty = torch.zeros(0, dtype=torch.float64)
        exp = Experience(
            rows=[], completions=[], batch=batch, engine_logps=engine_logps, rewards_by_fn={}, reward_failures=Failures(),
            scores_B=empty, global_scores=empty, counts=counts, time_rollout=0.0,
        )
        learner.score(exp)
        metrics.append(learner.update_policy(exp, adv))
    return metrics


def _worker(rank: int, world: int, model_dir: str, qwen2_dir: str, mixtral: str, out_dir: str) -> dict:
    """Both layouts in the same processes, one after the other (megatron's parallel state torn
    down in between), which saves a second start of the ranks."""
    results: dict = {layout: _layout(world, model_dir, *layout, out_dir) for layout in LAYOUTS}
    results["qwen2_moe"] = {layout: _hf_family_step(world, qwen2_dir, *layout) for layout in ((1, 2), (2, 2))}
    results["mixtral"] = {(2, 2): _hf_family_step(world, mixtral, 2, 2)}
    results["bf16_mixed_loss"] = _bf16_mixed_step(world, model_dir)
    return results


def _bf16_mixed_step(world: int, model_dir: str) -> float:
    """One bf16-mixed SFT step at tp=2 ep=2 (the router's autocast shim, cpu_shims.py)."""
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig
    from rltrain.config.schema import OptimConfig

    eng = MegatronEngine(
        model_dir, MegatronBackendConfig(tp=2, ep=2), OptimConfig(**OPTIM), 100, precision="bf16-mixed",
        collective_timeout_s=20,
    )
    metrics = eng.train_step(ragged_micro_batches(0, VOCAB), lambda out, mb: (-out.logps.values.mean(), {}))
    eng.teardown_communicators()
    return metrics["loss"]


def _hf_family_step(world: int, model_dir: str, tp: int, ep: int) -> dict:
    """Another family's logits and one SFT step's gradients, for comparison with Hugging Face."""
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig
    from rltrain.config.schema import OptimConfig

    # the gradients are recorded after clipping: none; lr 0: the second step sees the first's weights
    unchanged = OptimConfig(**{**OPTIM, "max_grad_norm": 0.0, "lr": 0.0})
    eng = MegatronEngine(
        model_dir, MegatronBackendConfig(tp=tp, ep=ep), unchanged, 100, collective_timeout_s=20,
        router_losses=RouterLosses(*ROUTER_COEFS),
    )
    batches = ragged_micro_batches(eng.rank, VOCAB) if tp == 1 else ragged_micro_batches(0, VOCAB) + ragged_micro_batches(1, VOCAB)
    n_tokens = sum(b.num_completion_tokens for r in range(world) for b in ragged_micro_batches(r, VOCAB))
    res: dict = dict(dp=eng.rank, logits=_logits(eng, batches), export=dict(eng.export_weights()))
    grads: list = []
    _record_grads(eng, grads)
    on = eng.router.info
    eng.router.info = dataclasses.replace(on, aux_loss_coef=0.0, z_loss_coef=0.0)  # the same engine, losses off
    res["metrics_off"] = eng.train_step(batches, lambda out, mb: (-out.logps.values.sum() / n_tokens, {}))
    eng.router.info = on
    res["metrics_on"] = eng.train_step(batches, lambda out, mb: (-out.logps.values.sum() / n_tokens, {}))
    res["grads"], res["grads_on"] = grads
    eng.teardown_communicators()
    return portable(res)


def _layout(world: int, model_dir: str, tp: int, pp: int, ep: int, out_dir: str) -> dict:
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig
    from rltrain.config.schema import OptimConfig

    torch.manual_seed(0)
    backend = MegatronBackendConfig(tp=tp, pp=pp, ep=ep)
    eng = MegatronEngine(model_dir, backend, OptimConfig(**OPTIM), 100, collective_timeout_s=20)
    # the same global batch: one replica's micro-batches each, or both on the one replica of tp=2
    batches = ragged_micro_batches(eng.rank, VOCAB) if tp * pp == 1 else ragged_micro_batches(0, VOCAB) + ragged_micro_batches(1, VOCAB)
    n_tokens = sum(b.num_completion_tokens for r in range(world) for b in ragged_micro_batches(r, VOCAB))
    experts = {n.split("local_experts.")[1].split(".")[0] for n, _ in eng.model.named_parameters() if "local_experts." in n}
    res: dict = dict(dp=eng.rank, local_experts=len(experts))
    res["logits"] = _logits(eng, batches) if pp == 1 else None
    res["export_before"] = dict(eng.export_weights())
    ckpt = Path(out_dir) / f"ckpt-tp{tp}-pp{pp}-ep{ep}"
    eng.save_checkpoint(ckpt)
    grads: list = []
    _record_grads(eng, grads)
    res["sft"] = _sft(eng, batches, n_tokens)
    res["sft_weights"] = dict(eng.export_weights())
    res["grpo"] = _grpo(eng) if (tp, pp, ep) in GRPO_LAYOUTS else []
    res["grads"] = grads
    res["weights"] = dict(eng.export_weights())
    eng.save_pretrained(Path(out_dir) / f"hf-tp{tp}-pp{pp}-ep{ep}")
    eng.load_checkpoint(ckpt)
    res["restored"] = all(torch.equal(t, res["export_before"][n]) for n, t in eng.export_weights())
    eng.teardown_communicators()
    return portable(res)


def _tensors(obj):
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(v) for v in obj)
    return obj


# -- the checks ------------------------------------------------------------------------------


def _check(tmp_path: Path, model_dir: Path, tp: int, pp: int, ep: int, results: list[dict]) -> list[dict]:
    from safetensors.torch import load_file

    hf = load_file(str(model_dir / "model.safetensors"))
    reference = _hf_logits(model_dir, [ragged_micro_batches(r, VOCAB) for r in range(2)])
    saved = load_file(str(tmp_path / f"hf-tp{tp}-pp{pp}-ep{ep}" / "model.safetensors"))
    for res in results:
        assert res["local_experts"] == 8 // ep
        expected = reference[res["dp"]] if tp * pp == 1 else reference[0] + reference[1]
        for ours, theirs in zip(res["logits"] or [], expected if pp == 1 else [], strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        assert set(res["export_before"]) == set(hf)
        assert all(torch.equal(res["export_before"][n], t) for n, t in hf.items()), "HF -> megatron -> HF changed a weight"
        assert set(saved) == set(hf) and all(torch.equal(saved[n], t) for n, t in res["weights"].items())
        assert res["restored"], "the checkpoint did not bring back every expert"
        steps = 2 * STEPS if (tp, pp, ep) in GRPO_LAYOUTS else STEPS
        assert len(res["grads"]) == steps and all(set(g) == set(hf) for g in res["grads"])
    return results


def test_ep2_matches_hf_and_ep1_over_sft_and_grpo(tmp_path: Path) -> None:
    model_dir = qwen3_moe_dir(tmp_path / "model")
    qwen2_dir, mixtral = qwen2_moe_dir(tmp_path / "qwen2_moe"), mixtral_dir(tmp_path / "mixtral")
    by_rank = _tensors(
        run_ranks(_worker, str(model_dir), str(qwen2_dir), str(mixtral), str(tmp_path), nproc=2, timeout_s=500,
                  pg_timeout_s=20)
    )
    _check_family(qwen2_dir, [r["qwen2_moe"] for r in by_rank])
    _check_family(mixtral, [r["mixtral"] for r in by_rank])
    assert all(math.isfinite(r["bf16_mixed_loss"]) and r["bf16_mixed_loss"] > 0 for r in by_rank)
    by_layout = {layout: _check(tmp_path, model_dir, *layout, [r[layout] for r in by_rank]) for layout in LAYOUTS}
    ep1 = by_layout[(1, 1, 1)]
    for layout in LAYOUTS[1:]:
        _assert_same_training(ep1, by_layout[layout], layout)
    assert ep1[0]["grpo"][-1]["loss"] != ep1[0]["grpo"][0]["loss"]  # the steps did something


def _check_family(model_dir: Path, results: list[dict]) -> None:
    from safetensors.torch import load_file

    hf = load_file(str(model_dir / "model.safetensors"))
    reference = _hf_logits(model_dir, [ragged_micro_batches(r, VOCAB) for r in range(2)])
    hf_grads = _hf_sft_grads(model_dir)
    hf_router = _hf_sft_grads(model_dir, ROUTER_COEFS)
    moved = max(float((hf_router[n] - g).abs().max()) for n, g in hf_grads.items())
    assert moved > 1e-3, moved  # the router losses change the gradient
    for by_layout in results:
        for (tp, _), res in by_layout.items():
            expected = reference[res["dp"]] if tp == 1 else reference[0] + reference[1]
            for ours, theirs in zip(res["logits"], expected, strict=True):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
            assert set(res["export"]) == set(hf) and all(torch.equal(res["export"][n], t) for n, t in hf.items())
            for grads, reference_grads in ((res["grads"], hf_grads), (res["grads_on"], hf_router)):
                assert set(grads) == set(hf)
                for name in hf:
                    torch.testing.assert_close(grads[name], reference_grads[name], atol=1e-5, rtol=0, msg=name)
            _assert_router_metrics(res["metrics_off"], res["metrics_on"], hf_router)


def _assert_router_metrics(off: dict, on: dict, hf: dict) -> None:
    """model.moe.aux_loss_coef and z_loss_coef on megatron (docs/moe.md, "Router losses and
    metrics"): the logged terms are the FSDP engine's (transformers' family loss, the z-loss and the
    load imbalance, per micro-batch over real tokens, averaged), and the loss grows by exactly
    coefficient x logged term."""
    assert "moe/aux_loss" not in off and "moe/z_loss" not in off
    for key in ("moe/aux_loss", "moe/z_loss", "moe/load_imbalance"):
        assert on[key] == pytest.approx(float(hf[key]), rel=1e-5), key
    assert off["moe/load_imbalance"] == pytest.approx(on["moe/load_imbalance"], rel=1e-6)
    added = ROUTER_COEFS[0] * on["moe/aux_loss"] + ROUTER_COEFS[1] * on["moe/z_loss"]
    assert on["loss"] - off["loss"] == pytest.approx(added, rel=1e-4), (on["loss"], off["loss"], added)
    assert on["grad_norm"] != pytest.approx(off["grad_norm"], rel=1e-4)


def _assert_same_training(reference: list[dict], results: list[dict], layout: tuple[int, int, int]) -> None:
    grpo = layout in GRPO_LAYOUTS
    for one, two in zip(reference, results):
        for phase in ("sft", "grpo") if grpo else ("sft",):
            for step, (m1, m2) in enumerate(zip(one[phase], two[phase], strict=True)):
                for key in ("loss", "grad_norm", "moe/load_imbalance"):  # the load: a maximum over pipeline stages too
                    assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (layout, phase, step, key)
                assert m2["safety/skipped_steps"] == 0.0
        for step, (g1, g2) in enumerate(zip(one["grads"][: len(two["grads"])], two["grads"], strict=True)):
            for name, grad in g1.items():
                torch.testing.assert_close(g2[name], grad, atol=1e-5, rtol=0, msg=f"{layout} step {step}: {name}")
        for key in ("sft_weights", "weights") if grpo else ("sft_weights",):
            for name, weight in one[key].items():
                torch.testing.assert_close(two[key][name], weight, atol=1e-5, rtol=0, msg=f"{layout} {key}: {name}")
