"""Vision-language models on CUDA, run as a user runs them: SFT on `model=tiny_vl` over a local
image dataset, and GRPO sampling with each prompt's images (one or two) through `rollout=hf` (the
CUDA build of vLLM is not on the GPU test machine: docs/gpus.md). Marked `gpu` (skipped without
CUDA). The image dataset is the CPU tests' (tests/vision_data.py)."""

from __future__ import annotations

import math

import pytest
from cli import rltrain, train_rows
from vision_data import reward_env

pytestmark = pytest.mark.gpu

BASE = ["model=tiny_vl", "logger.wandb.mode=disabled", "trainer.progress=lines", "trainer.save_every=0"]


def test_sft_on_images_trains_on_the_gpu(image_data, tmp_path):
    run_dir = tmp_path / "sft"
    rltrain("algo=sft", *BASE, f"data.path={image_data / 'sft.jsonl'}", "trainer.max_steps=3",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2", run_dir=run_dir, timeout=900)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["safety/recovered_errors"] == 0.0, r


def test_grpo_samples_with_images_on_the_gpu(image_data, tmp_path):
    run_dir = tmp_path / "grpo"
    rltrain("algo=grpo", *BASE, "rollout=hf", f"data.path={image_data / 'prompts.jsonl'}",
            "reward.fns=[spread_reward:spread]", "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2",
            "trainer.eval_every=0", "data.num_eval=2", run_dir=run_dir, env=reward_env(image_data), timeout=900)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # bf16-mixed on CUDA: the engine and the trainer agree to bf16's round-off
        assert math.isfinite(r["rollout/logprob_diff_max"]) and r["rollout/logprob_diff_max"] < 0.1, r
        assert r["safety/recovered_errors"] == 0.0, r


def test_time_sharing_moves_the_vision_tower_off_the_gpu(image_data, tmp_path):
    """Time sharing moves the whole model to the host for the engine's turn, the frozen vision tower
    (about three quarters of tiny_vl's weights) with the language model, and no number changes."""
    from safetensors import safe_open

    common = ["algo=grpo", *BASE, "rollout=hf", f"data.path={image_data / 'prompts.jsonl'}",
              "reward.fns=[spread_reward:spread]", "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2",
              "trainer.eval_every=0", "data.num_eval=2", "trainer.precision=fp32"]
    for name, shared in (("plain", "false"), ("shared", "true")):
        rltrain(*common, f"placement.time_sharing={shared}", run_dir=tmp_path / name, env=reward_env(image_data), timeout=900)
    plain, shared_rows = train_rows(tmp_path / "plain"), train_rows(tmp_path / "shared")
    weights_mib = tower_mib = 0.0
    for path in (tmp_path / "shared" / "final").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                mib = math.prod(f.get_slice(key).get_shape()) * 4 / 2**20  # fp32
                weights_mib += mib
                tower_mib += mib if "visual." in key else 0.0
    assert tower_mib > 0.5 * weights_mib  # the tower's share is large enough for the bound below to see it
    # the trainer's state on the GPU: every fp32 weight, AdamW's two moments of the trained (language) part
    state_mib = weights_mib + 2 * (weights_mib - tower_mib)
    for a, b in zip(plain, shared_rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], rel=1e-6)
        dropped = b["mem/train/allocated"] - b["mem/offload/allocated"]
        assert dropped >= 0.9 * state_mib, (dropped, state_mib, tower_mib, b)
        assert b["mem/onload/allocated"] >= b["mem/offload/allocated"] + 0.9 * state_mib, b
