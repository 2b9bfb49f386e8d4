"""The fast weight sync (rollout/vllm_reload.py) loads exactly what vLLM's layerwise reload loads.

For each supported architecture we update one engine through vLLM's reload (plus the tied-head
refresh: the original `update_weights`) with three perturbed checkpoints, recording greedy and
sampled completions after each; then update it through `update_weights`' fast path with the same
three checkpoints in turn and require the same tokens and the same log-probabilities. Also: an
engine whose plan cannot be built, and an update the plan does not fit, go through vLLM's reload.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.rollout import vllm_reload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from test_rollout_parity import PROMPTS, TINY, perturbed_state  # noqa: E402 - the parity suite's model and prompts

from rltrain.rollout.base import Completion, SamplingSettings

# One worker runs the module, in pytest's order: each architecture's engine is built once (the
# module-scoped `case`), not once per worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("test_vllm_reload")

CASES = {
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True, attention_bias=True),
    "qwen2-untied": dict(arch="qwen2", tie_word_embeddings=False, attention_bias=True),
    "llama-nobias-tied": dict(arch="llama", tie_word_embeddings=True, attention_bias=False),
    "llama-bias-untied": dict(arch="llama", tie_word_embeddings=False, attention_bias=True),
}
TOL = 1e-5

Weights = dict[str, torch.Tensor]


# In make test: qwen2 tied and llama untied (a tied and an untied head, the engines the fallback
# test below uses); the other two are `slow`: each architecture's sync runs at every step of
# test_cli_grpo.py's parity runs, in make test.
SLOW_CASES = ("qwen2-untied", "llama-nobias-tied")


@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def case(request, tiny_cache):
    """(engine, three perturbed checkpoints): one engine per architecture."""
    from transformers import AutoModelForCausalLM

    from rltrain.rollout.vllm import VLLMRolloutEngine

    cfg = ModelConfig(**TINY, **CASES[request.param], cache_dir=str(tiny_cache / "models"))
    model_dir = build_tiny_model_dir(cfg, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    states = [perturbed_state(hf, seed=seed, scale=0.2) for seed in (11, 12, 13)]
    engine = VLLMRolloutEngine(
        model_dir, VLLMRolloutConfig(kv_cache_gib=1, max_num_seqs=16, max_model_len=128), seed=0
    )
    yield engine, states
    engine.close()


def completions(engine) -> list[Completion]:
    """Greedy completions, then seeded samples (log-probabilities of the raw distribution)."""
    greedy = engine.generate(PROMPTS, SamplingSettings(n=1, temperature=0.0, max_new_tokens=12))
    sampled = engine.generate(PROMPTS, SamplingSettings(n=3, max_new_tokens=12, seed=5))
    return greedy + sampled


def layerwise_update(engine, state: Weights) -> None:
    """The original `update_weights`: vLLM's reload, the tied-head refresh, a prefix-cache reset."""
    engine._reload_in_place(state.items())
    if engine.tied:
        engine._refresh_tied_head()
    engine.llm.reset_prefix_cache()


def assert_same(got: list[Completion], want: list[Completion]) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
    assert diff < TOL


def spy_layerwise(engine, monkeypatch) -> list[int]:
    """Count the calls of vLLM's reload from now on (still running it)."""
    calls: list[int] = []
    reload = engine._reload_in_place

    def counted(weights):
        calls.append(1)
        reload(weights)

    monkeypatch.setattr(engine, "_reload_in_place", counted)
    return calls


def test_fast_path_matches_layerwise_reload(case, monkeypatch):
    engine, states = case
    references = []
    for state in states:
        layerwise_update(engine, state)
        references.append(completions(engine))
    assert references[0][0].token_ids != references[1][0].token_ids, "the checkpoints must differ"

    calls = spy_layerwise(engine, monkeypatch)
    for state, reference in zip(states, references, strict=True):  # first, second, third update
        engine.update_weights(state.items())
        assert_same(completions(engine), reference)
    assert not calls, "the fast path fell back to vLLM's reload"

    plan = engine._sync_plan
    assert isinstance(plan, vllm_reload.SyncPlan)
    assert "lm_head" in plan.repacks, "the output head must be repacked, tied or not"
    assert plan.shapes.keys() == engine.expected_names


def test_falls_back_when_the_plan_cannot_be_built(case, monkeypatch):
    engine, states = case
    layerwise_update(engine, states[0])
    reference = completions(engine)

    monkeypatch.setattr(vllm_reload, "_supported_models", tuple)  # no architecture is supported
    engine.__dict__.pop("_sync_plan", None)  # build the plan again, under the patch
    try:
        calls = spy_layerwise(engine, monkeypatch)
        engine.update_weights(states[1].items())
        engine.update_weights(states[0].items())
        assert engine._sync_plan is None
        assert len(calls) == 2
        assert_same(completions(engine), reference)
    finally:
        engine.__dict__.pop("_sync_plan", None)


@pytest.mark.parametrize(
    "names",
    [
        lambda names: {*names, "model.layers.0.mlp.act_fn.weight"},  # a module without that parameter
        lambda names: {*names, "model.rotary.weight"},  # no such module
        lambda names: names - {"model.layers.0.self_attn.k_proj.weight"},  # q and v without k
    ],
    ids=["unmapped-name", "unknown-module", "fused-in-part"],
)
def test_plan_refuses_names_it_cannot_map(case, names):
    engine, _ = case
    build = partial(vllm_reload.SyncPlan.build, names=names(engine.expected_names))
    with pytest.raises(vllm_reload.UnsupportedModel):
        engine.llm.apply_model(build)


@pytest.mark.parametrize("case", ["qwen2-tied", "llama-bias-untied"], indirect=True)
def test_an_update_the_plan_does_not_fit_falls_back(case, monkeypatch):
    """A partial update is left to vLLM's reload (and its error); a full one repairs the engine."""
    engine, states = case
    layerwise_update(engine, states[2])
    reference = completions(engine)

    calls = spy_layerwise(engine, monkeypatch)
    partial = [(n, t) for n, t in states[1].items() if "v_proj" not in n]
    with pytest.raises(ValueError, match="v_proj"):
        engine.update_weights(partial)
    assert len(calls) == 1
    engine.update_weights(states[2].items())
    assert len(calls) == 1
    assert_same(completions(engine), reference)
