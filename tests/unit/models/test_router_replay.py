"""Router replay (rltrain.models.moe.RouterReplay, RoutingRecorder; docs/moe.md "Router replay") on
tiny models of each family: replaying the trainer's own routing changes nothing, bitwise (outputs
and gradients); other experts change the outputs, and the router's gradient then flows through the
recorded experts' gate weights; the transformers engine records the routing the trainer computes."""

from __future__ import annotations

import pytest
import torch
from moe_families import FAMILIES, build_family_dir, family_config

from rltrain.models import moe


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    with torch.no_grad():  # decisive routing, as tests/moe_families.py draws it
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0.0, 1.0)
    moe.prepare_moe(model)
    return model


def _own_routing(model, ids_BT: torch.Tensor) -> torch.Tensor:
    """[B x T, layers, k]: the experts the model's routers choose for every position."""
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[2].detach())) for r in moe.routers(model)]
    with torch.no_grad():
        model(input_ids=ids_BT)
    for h in handles:
        h.remove()
    return torch.stack(seen, dim=1).to(moe.ROUTING_DTYPE)


def _forward(model, ids_BT: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids_BT).logits
    logits.float().log_softmax(-1)[..., 5].sum().backward()
    grads = [r.weight.grad.clone() for r in moe.routers(model)]
    return logits.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_trainers_own_routing_is_bitwise_no_replay(family):
    model = _model(family)
    ids_BT = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    base_logits, base_grads = _forward(model, ids_BT)
    own_NLK = _own_routing(model, ids_BT)
    replay = moe.RouterReplay(model, replay=True)
    replay.load(own_NLK)
    logits, grads = _forward(model, ids_BT)
    assert torch.equal(logits, base_logits)
    assert all(torch.equal(g, b) for g, b in zip(grads, base_grads, strict=True))
    agreed, recorded = replay.agreement().tolist()
    assert agreed == recorded == own_NLK.shape[0] * own_NLK.shape[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_other_experts_changes_the_outputs_and_trains_the_router_through_the_gates(family):
    model = _model(family)
    ids_BT = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    base_logits, _ = _forward(model, ids_BT)
    own_NLK = _own_routing(model, ids_BT)
    experts = moe.num_experts(model.config)
    other_NLK = (own_NLK + 1) % experts  # every recorded position to other experts (a set that differs)
    other_NLK[:2] = -1  # the first positions unrecorded: the router's own choice
    replay = moe.RouterReplay(model, replay=True)
    replay.load(other_NLK)
    logits, grads = _forward(model, ids_BT)
    # causal: the unrecorded prefix keeps its values (up to the grouped experts' batching round-off)
    assert torch.allclose(logits[0, :2], base_logits[0, :2], atol=1e-5)
    assert not torch.allclose(logits[0, 2:], base_logits[0, 2:])
    assert all(bool(g.abs().sum() > 0) for g in grads)  # through the gate weights of the replayed experts
    agreed, recorded = replay.agreement().tolist()
    layers = own_NLK.shape[1]
    assert recorded == 4 * layers and agreed < recorded
    # Off, the same record is only measured: the outputs are the router's own, bitwise.
    fresh = _model(family)
    measured = moe.RouterReplay(fresh, replay=False)
    measured.load(other_NLK)
    assert torch.equal(_forward(fresh, ids_BT)[0], base_logits)
    assert measured.agreement().tolist() == [agreed, recorded]


def test_the_replayed_gate_weights_follow_each_familys_normalisation():
    logits_NE = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    experts_NK = torch.tensor([[3, 0]])
    probs = logits_NE.softmax(-1)[0]

    class Router(torch.nn.Module):
        def __init__(self, norm: bool | None) -> None:
            super().__init__()
            if norm is not None:
                self.norm_topk_prob = norm

    raw = moe.replayed_weights(Router(False), logits_NE, experts_NK, logits_NE)
    assert torch.allclose(raw, torch.stack([probs[3], probs[0]])[None])
    for router in (Router(True), Router(None)):  # Qwen with norm_topk_prob, Mixtral (always)
        normed = moe.replayed_weights(router, logits_NE, experts_NK, logits_NE)
        assert torch.allclose(normed.sum(-1), torch.ones(1))


def test_the_transformers_engine_records_the_routing_the_trainer_computes(tmp_path):
    from rltrain.config.group_options import HFRolloutConfig
    from rltrain.rollout.base import SamplingSettings
    from rltrain.rollout.hf import HFRolloutEngine

    model_dir = build_family_dir("qwen3_moe", tmp_path / "m")
    engine = HFRolloutEngine(model_dir, HFRolloutConfig())
    prompts = [[5, 6, 7, 8], [9, 10]]
    completions = engine.generate(prompts, SamplingSettings(n=2, max_new_tokens=5, seed=3))
    assert engine.model is not None
    layers = len(moe.routers(engine.model))
    for c in completions:
        assert c.routing is not None and c.routing.dtype == moe.ROUTING_DTYPE
        assert tuple(c.routing.shape) == (len(c.token_ids), layers, 2)
        prompt = prompts[c.prompt_index]
        ids = torch.tensor([prompt + c.token_ids])
        own_TLK = _own_routing(engine.model, ids)
        scoring_NLK = own_TLK[len(prompt) - 1 : len(prompt) - 1 + len(c.token_ids)]  # the positions that sampled them
        assert torch.equal(scoring_NLK.sort(-1).values, c.routing.long().sort(-1).values.to(moe.ROUTING_DTYPE))


def test_the_routing_follows_the_sequences_a_completion_without_a_record_reads_minus_one():
    from rltrain.algos.rl.completion_records import recorded_routing
    from rltrain.data.batch import SequenceBatch
    from rltrain.rollout.base import Completion

    routed = torch.arange(3 * 2 * 2, dtype=moe.ROUTING_DTYPE).reshape(3, 2, 2)
    completions = [Completion(0, [4, 5, 6], [-1.0] * 3, True, routing=routed), Completion(0, [7, 8], [-1.0] * 2, True)]
    batch = SequenceBatch.from_lists([[1, 2], [1, 2]], [c.token_ids for c in completions])
    batch.routing = recorded_routing(completions)
    assert batch.routing is not None and tuple(batch.routing.values.shape) == (5, 2, 2)
    picked = batch.select([1, 0])
    assert picked.routing is not None
    second, first = picked.routing.split()
    assert torch.equal(first, routed) and bool((second == -1).all())
    assert recorded_routing([Completion(0, [4], [-1.0], True)]) is None  # an engine that records none
