"""A vision-language reward model (algo=rm's final/: the model plus `score.safetensors`) joins the
reward functions as `model` and reads each row's prompt images, which the scorer hands it alone
(user functions keep the dataset's columns); the launcher accepts it and names a vision-language
directory without the head. That its scores equal the trainer's: tests/dist/backends/test_vision_reward_model_export.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import compose_config

from rltrain.rewards.scoring import RewardScorer, build_reward_fns

COLOURS = [(220, 20, 20), (20, 20, 220), (20, 200, 20)]


@pytest.fixture(scope="module")
def vision_reward_dir(tiny_vl_dir, tmp_path_factory) -> Path:
    """tiny_vl plus a seeded head, as `write_score_head` writes it after training."""
    from rltrain.backends.sequence_classifier import write_score_head

    directory = tmp_path_factory.mktemp("vision_rm") / "final"
    shutil.copytree(tiny_vl_dir, directory)
    hidden = 64
    write_score_head(directory, torch.randn(1, hidden, generator=torch.Generator().manual_seed(3)))
    return directory


def _rows(model_dir):
    """(prompt texts in the model's markup, their images): one image each, two prompts, two colours."""
    from PIL import Image

    from rltrain.data.vision_rows import RowSource, VisionEncoder
    from rltrain.models.tokenizer import load_tokenizer
    from rltrain.models.vision import load_processor

    encoder = VisionEncoder(load_processor(model_dir, load_tokenizer(model_dir)))
    images = [[Image.new("RGB", (28, 28), c)] for c in COLOURS[:2]]
    prompts = [encoder.text_prompt("<image>Colour? ", im, i, RowSource("test", model_dir)) for i, im in enumerate(images)]
    return prompts, images


def test_the_scorer_hands_the_reward_model_each_rows_images(vision_reward_dir, tmp_path):
    from PIL import Image

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "<image>Colour? ", "images": ["a.png"]}\n')
    cfg = compose_config(f"data.path={data}", "reward_model=hf", f"reward_model.path={vision_reward_dir}",
                         "reward_model.batch_size=3")
    fns = build_reward_fns(cfg, torch.device("cpu"))
    assert [(rf.name, rf.reads_images) for rf in fns] == [("model", True)]
    model = fns[0].fn
    prompts, images = _rows(vision_reward_dir)
    prompts, completions = [prompts[0], prompts[0], prompts[1], prompts[1]], ["red", "blue", "red", "blue"]
    per_row = [images[0], images[0], images[1], images[1]]
    scorer = RewardScorer(fns, cfg.reward, cfg.safety.collective_timeout_s)
    try:  # the dataset's own image column (paths) rides along as for user functions, and is not what the model reads
        per_fn, failures = scorer.score(prompts, completions, {"images": [["a.png"]] * 4}, [0, 0, 1, 1], images=per_row)
    finally:
        scorer.close()
    assert failures.errors == failures.timeouts == 0
    one_by_one = [model([p], [c], prompt_images=[i])[0] for p, c, i in zip(prompts, completions, per_row)]
    assert per_fn["model"] == pytest.approx(one_by_one, abs=1e-5)  # batched (right-padded) as alone
    swapped = model(prompts, completions, prompt_images=[images[1], images[1], images[0], images[0]])
    assert all(a != pytest.approx(b, abs=1e-7) for a, b in zip(per_fn["model"], swapped))  # the image is read
    green = [Image.new("RGB", (56, 56), COLOURS[2])]  # 4 visual tokens: another length in the same batch
    mixed = model([prompts[0], prompts[0]], ["red", "red"], prompt_images=[images[0], green])
    assert mixed[0] == pytest.approx(per_fn["model"][0], abs=1e-5) and mixed[1] != pytest.approx(mixed[0], abs=1e-7)


def test_a_long_completion_keeps_its_end_and_the_prompt_its_images(vision_reward_dir):
    from rltrain.rewards.vision_model_reward import VisionSequenceReward

    prompts, images = _rows(vision_reward_dir)
    full = VisionSequenceReward(vision_reward_dir, torch.device("cpu"), torch.float32, batch_size=2, max_length=512)
    prompt_len = len(full.encode(prompts[0], "", images[0])[0])
    short = VisionSequenceReward(vision_reward_dir, torch.device("cpu"), torch.float32, batch_size=2, max_length=prompt_len + 3)
    assert short([prompts[0]], ["xxxxxred"], prompt_images=[images[0]]) == pytest.approx(
        full([prompts[0]], ["red"], prompt_images=[images[0]]), abs=1e-5
    )


def test_the_launcher_takes_a_vision_reward_model_and_names_one_without_its_head(vision_reward_dir, tiny_vl_dir):
    from rltrain.preflight.validate_roles import validate_reward_model
    from rltrain.runtime.errors import UserError

    cfg = compose_config("algo=grpo", "reward_model=hf", f"reward_model.path={vision_reward_dir}")
    validate_reward_model(cfg.reward_model, "grpo")
    cfg = compose_config("algo=grpo", "reward_model=hf", f"reward_model.path={tiny_vl_dir}")
    with pytest.raises(UserError, match="vision-language model without a reward head") as err:
        validate_reward_model(cfg.reward_model, "grpo")
    assert "algo=rm" in str(err.value) and "\n" not in str(err.value)


def test_an_rl_step_hands_each_completion_its_prompts_images(vision_reward_dir, tmp_path):
    """The RL experience path (`ExperienceCollector._score`) gives the reward model each
    completion's own prompt images (PromptRow.images), whichever prompt of the step it continues."""
    from rltrain.algos.rl.experience import ExperienceCollector
    from rltrain.data.prompt_data import PromptRow
    from rltrain.rollout.base import Completion

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "<image>Colour? ", "images": ["a.png"]}\n')
    cfg = compose_config(f"data.path={data}", "reward_model=hf", f"reward_model.path={vision_reward_dir}")
    fns = build_reward_fns(cfg, torch.device("cpu"))
    prompts, images = _rows(vision_reward_dir)
    rows = [PromptRow([], p, {"images": [f"{i}.png"]}, images=im) for i, (p, im) in enumerate(zip(prompts, images))]
    completions = [Completion(i, [], [], True) for i in (1, 0, 1)]
    collector = ExperienceCollector.__new__(ExperienceCollector)  # only its scoring: no engines
    collector.scorer = RewardScorer(fns, cfg.reward, cfg.safety.collective_timeout_s)
    try:
        per_fn, _ = collector._score(rows, completions, ["red", "blue", "green"])
    finally:
        collector.scorer.close()
    expected = fns[0].fn([prompts[1], prompts[0], prompts[1]], ["red", "blue", "green"],
                         prompt_images=[images[1], images[0], images[1]])
    assert per_fn["model"] == pytest.approx(expected, abs=1e-5)
