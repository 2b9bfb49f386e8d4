"""Rollout weights equal trainer weights for Mixture-of-Experts models on vLLM's CPU build
(docs/moe.md, "Weight sync"): every family rltrain loads by `model.path` runs in vLLM, and after an
update of every tensor (each expert included, sent under the checkpoint's per-expert names as the
trainer exports them) the engine's log-probabilities equal transformers'.

The update is also the case vLLM gets wrong on its own: its reload copies new experts over the CPU
kernel's prepacked ones (`forget_moe_kernels`). The transformers engine takes the same names into
its fused experts. Before and after the update, vLLM's record of the routing (router replay,
rltrain/rollout/vllm_routing.py) is, at every sampled token, the experts transformers' routers
choose at the position that sampled it, in every MoE layer."""

from __future__ import annotations

import pytest
import torch
from moe_families import FAMILIES, build_family_dir
from test_rollout_parity import PROMPTS, TOL, max_logprob_diff, perturbed_state

from rltrain.config.group_options import HFRolloutConfig, VLLMRolloutConfig
from rltrain.models import moe
from rltrain.rollout.base import SamplingSettings

pytestmark = pytest.mark.xdist_group("test_moe_rollout_parity")


# In `make test`: the shared expert (Qwen2-MoE) and Mixtral's own expert names; Qwen3-MoE is the
# tiny MoE's family (tests/e2e/test_cli_moe.py), OLMoE names its experts as Qwen2-MoE does.
IN_THE_GATE = {"qwen2_moe", "mixtral"}


def assert_the_record_is_the_models_routing(hf, prompts: list[list[int]], completions) -> None:
    """Each completion's [tokens, layers, k] record equals, as a set per (token, layer), the top-k of
    `hf`'s routers at the position before each token (the prompt's last for the first). One forward
    of every sequence, right-padded: a causal model's earlier positions do not see the padding."""
    rows = [prompts[c.prompt_index] + c.token_ids for c in completions]
    width = max(len(r) for r in rows)
    ids_BT = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in moe.routers(hf)]
    try:
        with torch.no_grad():
            hf(input_ids=ids_BT)
    finally:
        for hook in hooks:
            hook.remove()
    own_BTLK = torch.stack(seen, dim=1).view(len(rows), width, len(seen), -1)
    for c, own_TLK in zip(completions, own_BTLK, strict=True):
        start = len(prompts[c.prompt_index]) - 1
        assert c.routing is not None and c.routing.dtype == moe.ROUTING_DTYPE
        scoring_TLK = own_TLK[start : start + len(c.token_ids)]
        assert torch.equal(c.routing.long().sort(-1).values, scoring_TLK.sort(-1).values), c.prompt_index


@pytest.mark.parametrize("family", [f if f in IN_THE_GATE else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_moe_parity_after_update(family, tiny_cache):
    from transformers import AutoModelForCausalLM

    from rltrain.rollout.vllm import VLLMRolloutEngine

    model_dir = build_family_dir(family, tiny_cache / "moe_families" / family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = VLLMRolloutEngine(model_dir, VLLMRolloutConfig(kv_cache_gib=1, max_num_seqs=16, max_model_len=128), seed=0)
    try:
        sampling = SamplingSettings(n=4, max_new_tokens=16, seed=1)
        completions = engine.generate(PROMPTS, sampling)
        assert max_logprob_diff(hf, PROMPTS, completions) < TOL, "parity before any update"
        assert_the_record_is_the_models_routing(hf, PROMPTS, completions)

        state = perturbed_state(hf, seed=1)
        hf.load_state_dict(state, strict=False)
        engine.update_weights(moe.checkpoint_weights(hf, state.items()))
        completions = engine.generate(PROMPTS, sampling)
        diff = max_logprob_diff(hf, PROMPTS, completions)
        print(f"\n[{family}] max diff after an update {diff:.2e}")
        assert diff < TOL
        assert_the_record_is_the_models_routing(hf, PROMPTS, completions)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_hf_engine_takes_each_expert_under_its_checkpoint_name(family, tiny_cache):
    from transformers import AutoModelForCausalLM

    from rltrain.rollout.hf import HFRolloutEngine

    model_dir = build_family_dir(family, tiny_cache / "moe_families" / family)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = HFRolloutEngine(model_dir, HFRolloutConfig())
    state = perturbed_state(trainer, seed=2)
    engine.update_weights(moe.checkpoint_weights(trainer, state.items()))
    assert engine.model is not None
    live = dict(engine.model.named_parameters())
    assert live.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(live[name], tensor), name
