"""A vision-language model and an image dataset by Hub id, offline from the caches (tests/hub_cache.py
lays them as a download leaves them): the dataset's images are the `datasets` Image feature (PIL
images when read, not paths), the model a Qwen2-VL snapshot. SFT and GRPO (rollout=hf, the cheapest
engine that samples with images) each take two steps; the local-file formats are test_cli_vision.py's."""

from __future__ import annotations

import pytest
from cli import rltrain, train_rows
from hub_cache import lay_dataset, lay_model

pytestmark = pytest.mark.e2e

COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}
SHORT = ["trainer.max_steps=2", "trainer.eval_every=0", "data.num_eval=2", "logger.wandb.mode=disabled",
         "trainer.progress=lines"]


@pytest.fixture(scope="module")
def hub_ids(tiny_vl_dir) -> tuple[str, str]:
    from PIL import Image

    names = list(COLOURS)
    rows = [{"images": [Image.new("RGB", (28, 28) if i % 2 else (56, 56), COLOURS[names[i % 3]])],
             "prompt": "<image>Colour? ", "completion": names[i % 3], "answer": names[i % 3]} for i in range(8)]
    lay_dataset("test-org/colour-squares", "default", {"train": rows})
    lay_model("test-org/tiny-vl", tiny_vl_dir)
    return "test-org/tiny-vl", "test-org/colour-squares"


def test_sft_and_grpo_take_a_vision_model_and_an_image_dataset_by_hub_id(hub_ids, tmp_path):
    model_id, data_id = hub_ids
    common = [f"model.path={model_id}", f"data.path={data_id}", *SHORT]
    sft_dir = tmp_path / "sft"
    rltrain("algo=sft", *common, "trainer.global_batch_size=4", "trainer.micro_batch_size=2", run_dir=sft_dir, timeout=400)
    assert [r["step"] for r in train_rows(sft_dir)] == [1, 2]
    assert (sft_dir / "final" / "processor_config.json").exists()  # the processor travels with the model

    grpo_dir = tmp_path / "grpo"
    rltrain("algo=grpo", *common, "rollout=hf", "reward.fns=[rltrain.rewards.builtin:exact_match]",
            "algo.prompts_per_step=4", "algo.group_size=2", "optim.lr=1e-2", run_dir=grpo_dir, timeout=400)
    rows = train_rows(grpo_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # sampled with each prompt's image and scored with it: the trainer's log-probs are the engine's
        assert r["rollout/logprob_diff_max"] < 1e-3, r
