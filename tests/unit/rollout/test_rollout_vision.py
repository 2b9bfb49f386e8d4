"""vLLM's CPU engine with images (issue 63, rollouts): a tiny Qwen2-VL, one engine for the module.

Prompts with one and with two images (of different sizes) beside a text-only one, given as the
model's processor writes them (placeholders expanded) or with one placeholder per image; the
engine's log-probabilities equal the Hugging Face model's forward with the same images, before
and after a weight update that changes only the vision tower. That update must also empty vLLM's
encoder cache: the last test shows the engine failing without it.
"""

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

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.rollout.base import SamplingSettings

pytestmark = pytest.mark.xdist_group("test_rollout_vision")
TOL = 1e-3
SAMPLING = SamplingSettings(n=2, max_new_tokens=8, seed=5)


@pytest.fixture(scope="module")
def vl(tiny_vl_dir):
    """(engine, HF model, image processor, prompts, images, placeholder id): the module's one engine."""
    from transformers import Qwen2VLForConditionalGeneration

    from rltrain.rollout.vllm import VLLMRolloutEngine

    model_dir = tiny_vl_dir
    prompts, images, processor, pad = vision_rows(model_dir)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = VLLMRolloutEngine(model_dir, VLLMRolloutConfig(kv_cache_gib=1, max_num_seqs=16, max_model_len=512), seed=0)
    yield engine, hf, processor, prompts, images, pad
    engine.close()


def test_generate_with_images_matches_the_trainers_forward(vl):
    engine, hf, processor, prompts, images, pad = vl
    completions = engine.generate(prompts, SAMPLING, images=images)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in completions)
    assert [c.prompt_ids for c in completions[:6]] == [None] * 6, "an expanded row is the engine's prompt"
    expanded = expand(prompts[3], images[3], processor, pad)
    assert len(expanded) > len(prompts[3]) and completions[6].prompt_ids == completions[7].prompt_ids == expanded
    assert max_logprob_diff(hf, processor, prompts, images, completions, pad) < TOL
    # The image is seen: another image in row 0 changes its log-probabilities of the same tokens.
    other = engine.generate(prompts[:1], SAMPLING, images=[[picture(9, 56, 84)]])
    assert other[0].logprobs != completions[0].logprobs or other[0].token_ids != completions[0].token_ids


def test_a_vision_tower_update_reaches_the_engine_and_its_caches(vl):
    """Only `visual.*` tensors change: image rows' log-probabilities move and match the updated HF
    model (the encoder cache recomputed every image), the text-only row's stay exactly."""
    engine, hf, processor, prompts, images, pad = vl
    before = engine.generate(prompts, SAMPLING, images=images)
    state = vision_tower_update(hf, seed=7)
    engine.update_weights(state.items())
    after = engine.generate(prompts, SAMPLING, images=images)
    assert max_logprob_diff(hf, processor, prompts, images, after, pad) < TOL
    assert logprobs_of(after, 2) == logprobs_of(before, 2), "a text-only row does not see the vision tower"
    for row in (0, 1, 3):
        assert logprobs_of(after, row) != logprobs_of(before, row), f"row {row}'s images went through the old vision tower"


def test_a_mismatched_expansion_names_the_row(vl):
    engine, _, _, prompts, images, pad = vl
    short = list(prompts[0])
    short.remove(pad)  # one visual token fewer than the image has
    with pytest.raises(ValueError, match=r"prompt 0: its 1 image\(s\) take 5 visual tokens in the trainer's ids but 6"):
        engine.generate([short], SAMPLING, images=images[:1])


def test_without_the_encoder_cache_reset_the_next_generate_fails(vl, monkeypatch):
    """The trap `_reset_weight_caches` exists for (run last: the engine is unusable afterwards)."""
    engine, hf, _, prompts, images, _ = vl
    engine.generate(prompts[:1], SAMPLING, images=images[:1])  # the image's embedding is now cached
    monkeypatch.setattr(engine, "_reset_weight_caches", lambda: engine._live().reset_prefix_cache())
    engine.update_weights((n, p.detach()) for n, p in hf.named_parameters())
    with pytest.raises(RuntimeError, match="Encoder cache miss"):
        engine.generate(prompts[:1], SAMPLING, images=images[:1])
