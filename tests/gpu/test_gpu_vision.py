"""Vision-language models on CUDA, run as a user runs them: SFT on `model=tiny_vl` over a local
image dataset, and GRPO sampling with each prompt's images through `rollout=hf` (the CUDA build of
vLLM is not on the GPU test machine: docs/gpus.md). Marked `gpu` (skipped without CUDA)."""

from __future__ import annotations

import json
import math

import pytest
from cli import rltrain, train_rows

pytestmark = pytest.mark.gpu

COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}
BASE = ["model=tiny_vl", "logger.wandb.mode=disabled", "trainer.progress=lines", "trainer.save_every=0"]
SPREAD_REWARD = "def spread(prompts, completions, **_):\n    return [len(set(c)) / 8 for c in completions]\n"


@pytest.fixture(scope="module")
def image_data(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("gpu_vision_data")
    (root / "imgs").mkdir()
    sft, prompts = [], []
    names = list(COLOURS)
    for i in range(8):
        Image.new("RGB", (28, 28) if i % 2 else (56, 56), COLOURS[names[i % 3]]).save(root / "imgs" / f"{i}.png")
        sft.append({"images": [f"imgs/{i}.png"], "prompt": "<image>Colour? ", "completion": names[i % 3]})
        prompts.append({"images": [f"imgs/{i}.png"], "prompt": "<image>Colour? "})
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in sft))
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in prompts))
    (root / "spread_reward.py").write_text(SPREAD_REWARD)
    return root


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
            "trainer.eval_every=0", "data.num_eval=2", run_dir=run_dir, env={"PYTHONPATH": str(image_data)}, timeout=900)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # bf16-mixed on CUDA: the engine and the trainer agree to bf16's round-off
        assert math.isfinite(r["rollout/logprob_diff_max"]) and r["rollout/logprob_diff_max"] < 0.1, r
        assert r["safety/recovered_errors"] == 0.0, r
