"""Router replay on megatron (rltrain/backends/megatron/router_replay.py; docs/moe.md, "Router
replay") on 2 gloo ranks: in `make test` a tiny Qwen3-MoE at (tp, pp, ep) = (1, 1, 2) and (1, 2, 1)
with activation checkpointing (1F1B recomputes a micro-batch after the next one's forward); in
`slow` at (1, 1, 1) and (2, 1, 2), and a tiny Qwen2-MoE (gate weights not renormalised) at
(1, 1, 2).

The record is what the transformers engine returns: Hugging Face's own top-k at the position that
sampled each completion token. (a) Replaying it gives bitwise the log-probabilities, loss and
gradients of no record, and an agreement of 1.0 (so each token's record reached the position
megatron routes it at, through ep's dispatch, tp and the stages). (b) A record of other experts
changes the log-probabilities, which then equal, with every gradient (the router's through the
replayed gate weights), those of Hugging Face replaying it as the FSDP engine does (1e-5); the
agreement reads 0.0 with replay off, which then changes nothing, and at most 0.5 with replay on
(the first layer's 0.0; the second layer's own choice follows hidden states the replay moved).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import portable, ragged_micro_batches, run_ranks

from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged

pytestmark = pytest.mark.dist

VOCAB, EXPERTS, TOPK, LAYERS = 96, 8, 2, 2
OPTIM = dict(lr=1e-2, weight_decay=0.0, warmup_steps=0, schedule="constant", max_grad_norm=0.0)


def _moe_dir(path: Path, family: str) -> Path:
    """A tiny Qwen3-MoE (top-k renormalised) or Qwen2-MoE (not renormalised; a shared expert), its
    routers' weights drawn large (decisive routing: no near ties)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    shape = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=TOPK,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**shape, head_dim=32)
    else:
        config = Qwen2MoeConfig(**shape, shared_expert_intermediate_size=48, norm_topk_prob=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                std = 1.0 if name.endswith("mlp.gate.weight") else 0.15
                p.copy_(torch.randn_like(p) * std + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def _load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    from rltrain.models import moe

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    moe.prepare_moe(model)  # as the FSDP engine runs it
    return model


def _record(hf, seq: torch.Tensor, prompt: int, shift: int) -> torch.Tensor:
    """[T, layers, k]: the experts Hugging Face's routers choose at each position of `seq`, moved
    by `shift` (0: its own), -1 where the transformers engine records nothing (the prompt but its
    last position, and the last position)."""
    from rltrain.models import moe

    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in moe.routers(hf)]
    with torch.no_grad():
        hf(seq[None])
    for h in handles:
        h.remove()
    experts_TLK = (torch.stack(seen, dim=1) + shift) % EXPERTS
    experts_TLK[: prompt - 1] = -1
    experts_TLK[-1] = -1
    return experts_TLK.to(moe.ROUTING_DTYPE)


def _with_routing(batch: SequenceBatch, hf, shift: int) -> SequenceBatch:
    """`batch` with the record the transformers engine keeps: completion token p of a row carries
    the experts routed at position p - 1 (the forward that sampled it)."""
    per_seq = [
        _record(hf, seq, prompt, shift)[prompt - 1 : -1]
        for seq, prompt in zip(batch.tokens.split(), batch.prompt_lens.tolist(), strict=True)
    ]
    routing = Ragged.from_lengths(torch.cat(per_seq), batch.completion_lens())
    return SequenceBatch(batch.tokens, batch.prompt_lens, batch.extras, routing=routing)


def _worker(rank: int, world: int, model_dir: str, layouts: list[tuple[int, int, int]]) -> dict:
    hf = _load_hf(model_dir)
    return {layout: _layout(world, model_dir, hf, *layout) for layout in layouts}


def _layout(world: int, model_dir: str, hf, tp: int, pp: int, ep: int) -> dict:
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig
    from rltrain.config.schema import OptimConfig

    eng = MegatronEngine(
        model_dir, MegatronBackendConfig(tp=tp, pp=pp, ep=ep), OptimConfig(**OPTIM), 10, collective_timeout_s=20,
        router_replay=True, gradient_checkpointing=pp > 1,
    )
    plain = ragged_micro_batches(eng.rank, VOCAB) if tp * pp == 1 else ragged_micro_batches(0, VOCAB) + ragged_micro_batches(1, VOCAB)
    n_tokens = sum(b.num_completion_tokens for r in range(world) for b in ragged_micro_batches(r, VOCAB))
    own = [_with_routing(b, hf, 0) for b in plain]
    other = [_with_routing(b, hf, 1) for b in plain]
    grads: list[dict] = []

    def recorded_step(*args, **kwargs):  # keep the gradients, leave the weights as they are
        grads.append({n: p.grad.clone() for n, p in eng.model.named_parameters()})

    eng.optimizer.step = recorded_step

    def loss_fn(out, mb):
        return -out.logps.values.sum() / n_tokens, {}

    res: dict = {"dp": eng.rank}
    for name, batches in (("plain", plain), ("own", own), ("other", other)):
        res[f"logps_{name}"] = torch.cat([o.logps.values for o in eng.forward_logps(batches)])
        res[f"metrics_{name}"] = eng.train_step(batches, loss_fn)
    res["exact_grads"] = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    res["grads_other"] = _under_hf_names(eng, grads[2])
    eng.replay.replay = False  # the agreement is measured with replay off too, and nothing is replayed
    res["logps_other_off"] = torch.cat([o.logps.values for o in eng.forward_logps(other)])
    res["metrics_other_off"] = eng.train_step(other, loss_fn)
    eng.teardown_communicators()
    return portable(res)


def _under_hf_names(eng, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients exported like weights (every expert on every rank), to compare across layouts."""
    params = dict(eng.model.named_parameters())
    weights = {n: p.data for n, p in params.items()}
    try:
        for n, p in params.items():
            p.data = grads[n]
        return {name: t.clone() for name, t in eng.export_weights()}
    finally:
        for n, p in params.items():
            p.data = weights[n]


def _hf_replayed(model_dir: Path, shift: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Both ranks' completion log-probabilities and the summed loss's gradients (checkpoint names)
    of Hugging Face replaying the shifted record (rltrain.models.moe.RouterReplay, the FSDP side)."""
    from rltrain.models import moe

    hf = _load_hf(str(model_dir))
    replay = moe.RouterReplay(hf, replay=True)
    batches = ragged_micro_batches(0, VOCAB) + ragged_micro_batches(1, VOCAB)
    n_tokens = sum(b.num_completion_tokens for b in batches)
    logps = []
    for seq, prompt in ((s, p) for b in batches for s, p in zip(b.tokens.split(), b.prompt_lens.tolist())):
        replay.load(None)  # Hugging Face's own routing, then the record made of it
        replay.load(_record(hf, seq, prompt, shift))
        logp_TV = torch.log_softmax(hf(seq[None]).logits[0].float(), -1)[prompt - 1 : -1]
        logps.append(logp_TV.gather(-1, seq[prompt:, None])[:, 0])
    torch.cat(logps).sum().div(-n_tokens).backward()
    grads = {}
    for name, param in hf.named_parameters():  # the fused experts under each expert's checkpoint names
        if name.endswith("experts.gate_up_proj"):
            gate_EIH, up_EIH = param.grad.chunk(2, dim=1)
            for e in range(EXPERTS):
                grads[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate_EIH[e]
                grads[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up_EIH[e]
        elif name.endswith("experts.down_proj"):
            for e in range(EXPERTS):
                grads[name.replace("down_proj", f"{e}.down_proj.weight")] = param.grad[e]
        else:
            grads[name] = param.grad
    return torch.cat(logps).detach(), grads


def _check(layout: tuple[int, int, int], res: dict, hf_logps: torch.Tensor, hf_grads: dict, split: int) -> None:
    tp, pp, _ = layout
    for key in ("logps_plain", "logps_own", "logps_other", "logps_other_off"):
        res[key] = torch.from_numpy(res[key])
    # (a) the trainer's own routing replayed: bitwise no replay, and every record met its position
    assert torch.equal(res["logps_own"], res["logps_plain"]), layout
    assert res["metrics_own"]["loss"] == res["metrics_plain"]["loss"] and res["exact_grads"], layout
    assert "moe/router_agreement" not in res["metrics_plain"]
    assert res["metrics_own"]["moe/router_agreement"] == 1.0, layout
    # (b) other experts: other outputs, those of Hugging Face replaying the same record (the router's
    # gradient through the replayed gate weights included); replay off measures and changes nothing
    assert (res["logps_other"] - res["logps_plain"]).abs().max() > 1e-2, layout
    # the first layer agrees nowhere; the second's own choice follows the first's replay (by chance)
    assert res["metrics_other"]["moe/router_agreement"] <= 0.5, layout
    expected = hf_logps if tp * pp > 1 else (hf_logps[:split] if res["dp"] == 0 else hf_logps[split:])
    torch.testing.assert_close(res["logps_other"], expected, atol=1e-5, rtol=0)
    assert set(res["grads_other"]) == set(hf_grads)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(torch.from_numpy(res["grads_other"][name]), grad, atol=1e-5, rtol=0, msg=f"{layout} {name}")
    assert torch.equal(res["logps_other_off"], res["logps_plain"]), layout
    assert res["metrics_other_off"]["moe/router_agreement"] == 0.0
    assert res["metrics_other_off"]["loss"] == res["metrics_plain"]["loss"], layout


@pytest.mark.parametrize(
    "family, layouts",
    [
        pytest.param("qwen3_moe", [(1, 1, 2), (1, 2, 1)], id="ep2-pp2"),
        pytest.param("qwen3_moe", [(1, 1, 1), (2, 1, 2)], id="ep1-tp2ep2", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", [(1, 1, 2)], id="qwen2_moe-ep2", marks=pytest.mark.slow),
    ],
)
def test_megatron_replays_the_recorded_experts(family, layouts, tmp_path: Path) -> None:
    model_dir = _moe_dir(tmp_path / "moe", family)
    by_rank = run_ranks(_worker, str(model_dir), layouts, nproc=2, timeout_s=300, pg_timeout_s=20)
    hf_logps, hf_grads = _hf_replayed(model_dir, shift=1)
    split = sum(b.num_completion_tokens for b in ragged_micro_batches(0, VOCAB))
    assert hf_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    for layout in layouts:
        for res in (r[layout] for r in by_rank):
            _check(layout, res, hf_logps, hf_grads, split)
