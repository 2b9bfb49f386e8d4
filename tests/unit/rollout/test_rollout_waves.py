"""The CPU build of vLLM raises when it prefills a seeded request in chunks (it rewinds the
request's generator, which a CPU generator cannot do), which happens as soon as the requests it
admits at once hold more prompt tokens than its token budget: many multi-turn episodes at their
second turn, or long prompts. `prefill_waves` splits such a call into waves that each fit
(rltrain/rollout/vllm.py); the real engine then generates the batch, and the seeds stay per prompt."""

from __future__ import annotations

import pytest

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.rollout.base import SamplingSettings
from rltrain.rollout.vllm import prefill_waves


def test_a_batch_that_fits_is_one_call_as_ever():
    # the default GRPO step: 64 prompts x 8, about 15 tokens each, 256 sequences at once, 4096 tokens
    assert prefill_waves([15] * 64, 8, 256, 4096) == [(0, 64)]
    assert prefill_waves([], 8, 256, 4096) == [(0, 0)]


def test_waves_hold_at_most_the_budget_and_the_sequence_limit():
    waves = prefill_waves([30] * 40, 8, 256, 4096)  # 256 sequences of 30 tokens: 7680 > 4096
    assert waves == [(0, 17), (17, 34), (34, 40)]  # 17 prompts x 8 x 30 = 4080 tokens
    assert prefill_waves([10] * 40, 8, 64, 100_000) == [(0, 40)]  # the limit alone never chunks a prefill
    # one long prompt splits the call; then at most 8 sequences (2 prompts x 4) per wave
    assert prefill_waves([100] + [5] * 6, 4, 8, 200) == [(0, 1), (1, 3), (3, 5), (5, 7)]
    assert prefill_waves([5000, 10], 1, 256, 4096) == [(0, 1), (1, 2)]  # alone in its wave


@pytest.fixture(scope="module")
def engine(tiny_cache):
    from rltrain.rollout.vllm import VLLMRolloutEngine

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                      cache_dir=str(tiny_cache / "models"))
    engine = VLLMRolloutEngine(build_tiny_model_dir(cfg, seed=0), VLLMRolloutConfig(kv_cache_gib=1), seed=0)
    yield engine
    engine.close()


def test_the_engine_generates_a_batch_too_big_for_one_prefill_and_keeps_each_prompts_seed(engine):
    prompts = [[1] + [20 + (i + k) % 60 for k in range(29)] for i in range(40)]  # 40 x 30 tokens, 8 each
    sampling = SamplingSettings(n=8, max_new_tokens=4, seed=3)
    out = engine.generate(prompts, sampling)  # one call would prefill 7680 tokens against a 4096 budget
    assert [c.prompt_index for c in out] == [i for i in range(40) for _ in range(8)]
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 for c in out)
    alone = engine.generate(prompts[:3], sampling)  # the first wave's first prompts, in a call of their own
    assert [c.token_ids for c in alone] == [c.token_ids for c in out[:24]]
