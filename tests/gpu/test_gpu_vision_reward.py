"""A vision-language reward model on CUDA, as a user runs it: `algo=rm` on `model=tiny_vl` over
image pairs, then GRPO (`rollout=hf`) scored by its `final/` with `reward_model=hf`, which reads
each prompt's images on the training device. Marked `gpu` (skipped without CUDA). The image
dataset is the CPU tests' (tests/vision_data.py); the CPU twin: tests/e2e/test_cli_vision_rl.py."""

from __future__ import annotations

import math

import pytest
from cli import rltrain, train_rows

pytestmark = pytest.mark.gpu

BASE = ["model=tiny_vl", "logger.wandb.mode=disabled", "trainer.progress=lines", "trainer.save_every=0"]


def test_a_vision_reward_model_trains_and_scores_on_the_gpu(image_data, tmp_path):
    rm_dir = tmp_path / "rm"
    rltrain("algo=rm", *BASE, f"data.path={image_data / 'pref.jsonl'}", "data.num_eval=2", "trainer.max_steps=2",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2", run_dir=rm_dir, timeout=900)
    rows = train_rows(rm_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    grpo_dir = tmp_path / "grpo"
    rltrain("algo=grpo", *BASE, "rollout=hf", f"data.path={image_data / 'prompts.jsonl'}", "reward_model=hf",
            f"reward_model.path={rm_dir / 'final'}", "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2",
            "trainer.eval_every=0", "data.num_eval=2", run_dir=grpo_dir, timeout=900)
    for r in train_rows(grpo_dir):
        assert math.isfinite(r["reward/model"]) and r["safety/recovered_errors"] == 0.0, r
