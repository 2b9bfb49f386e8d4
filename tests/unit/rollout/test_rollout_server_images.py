"""`rollout=server` with images (issue 63): one vLLM API server on the tiny Qwen2-VL, spawned by
the fleet; prompts sent as token ids plus `image_url` content parts holding PNG data URLs, the
vision tower pushed over the weight push, log-probabilities equal to the trainer-style forward
before and after (the push also resets the server's encoder cache: the same images again)."""

from __future__ import annotations

import pytest
import torch
from vl_parity import logprobs_of, max_logprob_diff, vision_rows, vision_tower_update

from rltrain.config.group_options import ServerRolloutConfig, ServersConfig
from rltrain.rollout.base import SamplingSettings
from rltrain.rollout.server.fleet import ServerFleetEngine

pytestmark = [pytest.mark.xdist_group("rollout_servers")]
SAMPLING = SamplingSettings(n=2, max_new_tokens=6, seed=5)
TOL = 1e-3


# slow: a cold vLLM server of its own. In make test: the image content parts' encoding
# (test_rollout_images.py), vLLM's parity with images (test_rollout_vision.py) and the server push.
@pytest.mark.slow
def test_server_fleet_with_images(tiny_vl_dir, tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    model_dir = tiny_vl_dir
    prompts, images, processor, pad = vision_rows(model_dir)
    trainer = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = ServerRolloutConfig(servers=ServersConfig(spawn=1, start_timeout_s=180), timeout_s=60, max_model_len=512)
    engine = ServerFleetEngine(cfg, model_dir, dtype="float32", rank=0, cuda=False, log_dir=tmp_path)
    try:
        before = engine.generate(prompts, SAMPLING, images=images)
        assert [c.prompt_index for c in before] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert [c.prompt_ids for c in before[:6]] == [None] * 6
        assert before[6].prompt_ids is not None and len(before[6].prompt_ids) > len(prompts[3])
        assert max_logprob_diff(trainer, processor, prompts, images, before, pad) < TOL
        engine.update_weights(vision_tower_update(trainer, seed=7).items())
        after = engine.generate(prompts, SAMPLING, images=images)
        assert max_logprob_diff(trainer, processor, prompts, images, after, pad) < TOL
        assert logprobs_of(after, 0) != logprobs_of(before, 0)
    finally:
        engine.close()
