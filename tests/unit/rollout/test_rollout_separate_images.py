"""`rollout.process=separate` with images (issue 63): the images cross the JSON control channel
as PNG data URLs, the vision tower's tensors cross the weight transport, and the child's
log-probabilities equal the trainer-style forward before and after that update."""

from __future__ import annotations

import pytest
import torch
from vl_parity import logprobs_of, max_logprob_diff, vision_rows, vision_tower_update

from rltrain.rollout.base import SamplingSettings

# A separate-engine run: none may overlap the tests that count rlsep-* directories (test_rollout_separate.py).
pytestmark = pytest.mark.xdist_group("separate_engine")
SAMPLING = SamplingSettings(n=2, max_new_tokens=6, seed=5)
TOL = 1e-3


@pytest.mark.slow  # images through a separate engine, in make test: tests/e2e/test_cli_vision_rl.py (PPO generating ahead)
def test_separate_engine_with_images(tiny_vl_dir):
    from transformers import Qwen2VLForConditionalGeneration

    from rltrain.config.group_options import VLLMRolloutConfig
    from rltrain.rollout.separate import SeparateVLLMEngine

    model_dir = tiny_vl_dir
    prompts, images, processor, pad = vision_rows(model_dir)
    trainer = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = VLLMRolloutConfig(kv_cache_gib=1, timeout_s=60, bucket_mb=1, max_model_len=512)
    engine = SeparateVLLMEngine(model_dir, cfg, seed=0, num_threads=1)
    try:
        before = engine.generate(prompts, SAMPLING, images=images)
        assert [c.prompt_index for c in before] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert before[6].prompt_ids is not None and len(before[6].prompt_ids) > len(prompts[3])
        assert max_logprob_diff(trainer, processor, prompts, images, before, pad) < TOL
        engine.update_weights(vision_tower_update(trainer, seed=7).items())  # 1 MiB buckets
        after = engine.generate(prompts, SAMPLING, images=images)
        assert max_logprob_diff(trainer, processor, prompts, images, after, pad) < TOL
        assert logprobs_of(after, 0) != logprobs_of(before, 0)
    finally:
        engine.close()
