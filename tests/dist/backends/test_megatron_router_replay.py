"""Router replay on megatron (rltrain/backends/megatron/router_replay.py; docs/moe.md, "Router
replay"), on 2 gloo ranks at (tp, pp, ep) = (1, 1, 1), (1, 1, 2), (2, 1, 2) and (1, 2, 1) with
activation checkpointing (a 1F1B recompute of a micro-batch after the next one's forward).

The record is what the transformers engine would return: Hugging Face's own top-k at the position
that sampled each completion token. Replaying it gives bitwise the log-probabilities, loss and
gradients of no record, and an agreement of 1.0 (which also proves each token's record reaches the
position megatron routes it at); a record of other experts changes the log-probabilities, gives
the router a gradient through the replayed experts' gate weights, reads an agreement of 0.0 (also
with replay off, which then changes nothing) and gives the same log-probabilities and gradients in
every layout (1e-5: the record follows each token through ep's dispatch, tp and the stages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_ranks

from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged

pytestmark = pytest.mark.dist

VOCAB, EXPERTS, TOPK, LAYERS = 96, 8, 2, 2
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)]
OPTIM = dict(lr=1e-2, weight_decay=0.0, warmup_steps=0, schedule="constant", max_grad_norm=0.0)


def _moe_dir(path: Path) -> Path:
    """A tiny Qwen3-MoE, its routers' weights drawn large (decisive routing: no near ties)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=TOPK,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                std = 1.0 if name.endswith("mlp.gate.weight") else 0.15
                p.copy_(torch.randn_like(p) * std + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def _batches(rank: int) -> list[SequenceBatch]:
    g = torch.Generator().manual_seed(10 + rank)
    shapes = [[(3, 5), (6, 2)], [(4, 7)]] if rank == 0 else [[(2, 6)], [(5, 3), (7, 1)]]
    return [
        SequenceBatch.from_lists(
            [torch.randint(0, VOCAB, (p,), generator=g).tolist() for p, _ in mb],
            [torch.randint(0, VOCAB, (c,), generator=g).tolist() for _, c in mb],
        )
        for mb in shapes
    ]


def _with_routing(batch: SequenceBatch, hf, shift: int) -> SequenceBatch:
    """`batch` with the record the transformers engine keeps: for completion token p of a row, the
    experts Hugging Face's routers choose at position p - 1, each moved by `shift` (0: its own)."""
    from rltrain.models import moe

    per_seq = []
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in moe.routers(hf)]
    for seq, prompt in zip(batch.tokens.split(), batch.prompt_lens.tolist(), strict=True):
        seen.clear()
        with torch.no_grad():
            hf(seq[None])
        experts_TLK = torch.stack(seen, dim=1)  # [T, layers, k]
        per_seq.append((experts_TLK[prompt - 1 : len(seq) - 1] + shift) % EXPERTS)
    for h in handles:
        h.remove()
    routing = Ragged.from_lengths(torch.cat(per_seq).to(moe.ROUTING_DTYPE), batch.completion_lens())
    return SequenceBatch(batch.tokens, batch.prompt_lens, batch.extras, routing=routing)


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {layout: _layout(world, model_dir, hf, *layout) for layout in LAYOUTS}


def _layout(world: int, model_dir: str, hf, tp: int, pp: int, ep: int) -> dict:
    from rltrain.backends.megatron.engine import MegatronEngine
    from rltrain.config.group_options import MegatronBackendConfig
    from rltrain.config.schema import OptimConfig

    eng = MegatronEngine(
        model_dir, MegatronBackendConfig(tp=tp, pp=pp, ep=ep), OptimConfig(**OPTIM), 10, collective_timeout_s=20,
        router_replay=True, gradient_checkpointing=pp > 1,
    )
    plain = _batches(eng.rank) if tp * pp == 1 else _batches(0) + _batches(1)
    n_tokens = sum(b.num_completion_tokens for r in range(world) for b in _batches(r))
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
        res[f"logps_{name}"] = [o.logps.values for o in eng.forward_logps(batches)]
        res[f"metrics_{name}"] = eng.train_step(batches, loss_fn)
    res["exact_grads"] = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    routers = [n for n in grads[0] if n.endswith("router.weight")]
    res["router_grads"] = [(float(grads[2][n].abs().sum()), float((grads[2][n] - grads[0][n]).abs().max())) for n in routers]
    res["grads_other"] = _under_hf_names(eng, grads[2])
    eng.replay.replay = False  # the agreement is measured with replay off too, and nothing is replayed
    res["logps_other_off"] = [o.logps.values for o in eng.forward_logps(other)]
    res["metrics_other_off"] = eng.train_step(other, loss_fn)
    eng.teardown_communicators()
    return _portable(res)


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


def _portable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def test_megatron_replays_the_recorded_experts_in_every_layout(tmp_path: Path) -> None:
    model_dir = _moe_dir(tmp_path / "moe")
    by_rank = run_ranks(_worker, str(model_dir), nproc=2, timeout_s=300, pg_timeout_s=20)
    first = {r[(1, 1, 1)]["dp"]: r[(1, 1, 1)] for r in by_rank}
    for layout in LAYOUTS:
        for res in (r[layout] for r in by_rank):
            for plain, own in zip(res["logps_plain"], res["logps_own"], strict=True):
                assert (plain == own).all(), layout  # bitwise
            assert res["metrics_own"]["loss"] == res["metrics_plain"]["loss"] and res["exact_grads"], layout
            assert "moe/router_agreement" not in res["metrics_plain"]
            assert res["metrics_own"]["moe/router_agreement"] == 1.0, layout
            assert res["metrics_other"]["moe/router_agreement"] == 0.0, layout
            assert res["metrics_other_off"]["moe/router_agreement"] == 0.0, layout
            assert max(abs(o - p).max() for o, p in zip(res["logps_other"], res["logps_plain"])) > 1e-2, layout
            for plain, off in zip(res["logps_plain"], res["logps_other_off"], strict=True):
                assert (plain == off).all(), layout
            assert res["metrics_other_off"]["loss"] == res["metrics_plain"]["loss"]
            assert len(res["router_grads"]) == LAYERS // layout[1]
            assert all(total > 0 and moved > 1e-6 for total, moved in res["router_grads"]), (layout, res["router_grads"])
            # the same replayed log-probabilities and gradients as (1, 1, 1): each token met its record
            expected = first[res["dp"]]["logps_other"] if layout[0] * layout[1] == 1 else (
                first[0]["logps_other"] + first[1]["logps_other"]
            )
            for ours, theirs in zip(res["logps_other"], expected, strict=True):
                torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(theirs), atol=1e-5, rtol=0)
            for name, grad in first[0]["grads_other"].items():
                torch.testing.assert_close(
                    torch.from_numpy(res["grads_other"][name]), torch.from_numpy(grad), atol=1e-5, rtol=0,
                    msg=f"{layout}: {name}",
                )
