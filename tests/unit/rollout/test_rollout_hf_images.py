"""`rollout=hf` with images (issue 63): transformers' generate on a tiny Qwen2-VL, the rows the vLLM
engine tests use; log-probabilities equal the trainer-style forward before and after a vision
tower update, and the rows it cannot read are named."""

from __future__ import annotations

import pytest
import torch
from vl_parity import (
    expand,
    logprobs_of,
    max_logprob_diff,
    picture,
    vision_rows,
    vision_tower_update,
)

from rltrain.config.group_options import HFRolloutConfig
from rltrain.rollout.base import SamplingSettings

SAMPLING = SamplingSettings(n=2, max_new_tokens=8, seed=5)
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_vl(tiny_vl_dir):
    from transformers import Qwen2VLForConditionalGeneration

    from rltrain.rollout.hf import HFRolloutEngine

    model_dir = tiny_vl_dir
    prompts, images, processor, pad = vision_rows(model_dir)
    trainer = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return HFRolloutEngine(model_dir, HFRolloutConfig(), seed=0), trainer, processor, prompts, images, pad


def test_generate_with_images_and_a_vision_tower_update(hf_vl):
    engine, trainer, processor, prompts, images, pad = hf_vl
    before = engine.generate(prompts, SAMPLING, images=images)
    assert [c.prompt_index for c in before] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [c.prompt_ids for c in before[:6]] == [None] * 6
    assert before[6].prompt_ids == expand(prompts[3], images[3], processor, pad) != prompts[3]
    assert max_logprob_diff(trainer, processor, prompts, images, before, pad) < TOL

    engine.update_weights(vision_tower_update(trainer, seed=7).items())
    after = engine.generate(prompts, SAMPLING, images=images)
    assert max_logprob_diff(trainer, processor, prompts, images, after, pad) < TOL
    assert logprobs_of(after, 2) == logprobs_of(before, 2)
    assert all(logprobs_of(after, row) != logprobs_of(before, row) for row in (0, 1, 3))


def test_rows_it_cannot_read_are_named(hf_vl):
    engine, _, _, prompts, images, pad = hf_vl
    with pytest.raises(ValueError, match=r"prompt 0 has 6 image token\(s\) in 1 placeholder\(s\) for 2 image\(s\)"):
        engine.generate(prompts[:1], SAMPLING, images=[[picture(0, 56, 84), picture(1, 28, 28)]])
    short = list(prompts[0])
    short.remove(pad)
    with pytest.raises(ValueError, match=r"prompt 0 has 5 image token\(s\) in 1 placeholder\(s\) for 1 image\(s\) that take \[6\]"):
        engine.generate([short], SAMPLING, images=images[:1])
