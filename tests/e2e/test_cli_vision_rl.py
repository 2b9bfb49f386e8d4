"""Vision-language models end to end beyond SFT, DPO and GRPO (test_cli_vision.py): KTO on image
rows with LoRA, the same on one rank and two (each example's images ride with it through the rank
slices); PPO on vLLM with its critic on the same backbone, generating ahead one step, killed by
SIGKILL and resumed to exactly the uninterrupted rows (the checkpointed batches in flight come back
with their rows' images); time sharing on a GRPO run with images changing no number; and a reward
model trained on image pairs (algo=rm) scoring a GRPO run on image prompts (`reward_model=hf`). The image dataset: tests/vision_data.py."""

from __future__ import annotations

import math
import signal

import pytest
from cli import comparable, kill_when, read_metrics, rltrain, train_rows
from vision_data import grpo_vision_run, reward_env

pytestmark = pytest.mark.e2e

KTO_KEYS = ("loss", "grad_norm", "kto/kl", "kto/rewards_chosen", "kto/rewards_rejected")
PPO_KEYS = ("critic/value_loss", "critic/grad_norm", "critic/values_mean", "policy/clipfrac", "adv/std")
PHASES = ("offload", "wake", "sync", "generate", "sleep", "onload", "train")


def kto_run(image_data, run_dir, nproc: int) -> list[dict]:
    data = image_data / "unpaired.jsonl"
    rltrain("algo=kto", "model=tiny_vl", f"data.path={data}", f"data.eval_path={data}", "data.num_eval=4",
            "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.eval_every=2",
            "trainer.save_every=0", "model.lora.rank=4", "optim.lr=1e-2", f"trainer.nproc={nproc}",
            "logger.wandb.mode=disabled", run_dir=run_dir, timeout=400)
    return read_metrics(run_dir)


# slow: images riding with their rows through rank slices run in test_cli_vision.py's two-rank DPO in make
# test; KTO on two ranks in test_cli_kto.py.
@pytest.mark.slow
def test_kto_on_images_with_lora_is_the_same_on_one_rank_and_two(tiny_cache, image_data, tmp_path):
    one, two = kto_run(image_data, tmp_path / "one", 1), kto_run(image_data, tmp_path / "two", 2)
    rows_one, rows_two = [r for r in one if "loss" in r], [r for r in two if "loss" in r]
    assert [r["step"] for r in rows_one] == [r["step"] for r in rows_two] == [1, 2]
    for r in rows_one + rows_two:
        assert all(math.isfinite(r[k]) for k in KTO_KEYS), r
    # step 1: the policy is the reference (LoRA's B is zero), so z0 = 0 and each example loses 1/2
    assert rows_one[0]["kto/kl"] == 0.0 and rows_one[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert rows_one[0]["grad_norm"] > 0 and rows_one[1]["loss"] != rows_one[0]["loss"]
    # two ranks score and train the same examples, each with its own images: the same numbers
    for a, b in zip(rows_one, rows_two, strict=True):
        for key in KTO_KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a, b)
    evals = [r for r in two if "eval/dpo_accuracy" in r]  # held-out pairs matched per prompt and image
    assert [r["step"] for r in evals] == [0, 2]


# slow: resume after SIGKILL with batches in flight is test_cli_async.py's, images through vLLM
# test_cli_vision.py's, both in make test.
@pytest.mark.slow
def test_ppo_on_images_generating_ahead_resumes_after_sigkill_to_the_uninterrupted_run(tiny_cache, image_data, tmp_path):
    args = ["algo=ppo", "model=tiny_vl", f"data.path={image_data / 'prompts.jsonl'}", "reward.fns=[spread_reward:spread]",
            "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=3", "trainer.save_every=1",
            "placement.max_staleness=1", "rollout.process=separate", "trainer.eval_every=0", "data.num_eval=2",
            "optim.lr=1e-2", "logger.wandb.mode=disabled", "trainer.progress=lines"]
    env = reward_env(image_data)
    whole = tmp_path / "whole"
    rltrain(*args, run_dir=whole, env=env, timeout=600)
    rows = train_rows(whole)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in PPO_KEYS) and r["grad_norm"] > 0, r
    # step 1 samples with the weights it trains; later steps one version behind (no parity to log)
    assert rows[0]["rollout/logprob_diff_max"] < 1e-3 and rows[0]["rollout/staleness_max"] == 0.0
    assert [r["rollout/staleness_max"] for r in rows[1:]] == [1.0, 1.0]

    # Killed once step 1's checkpoint is written (step 2's batch generated and in it, step 3's prompts):
    # steps 2 and 3 still to train, so the kill lands before the run's end however fast a step is.
    killed = tmp_path / "killed"
    kill_when(args, killed, killed / "checkpoints" / "step_00000001", signal.SIGKILL, timeout=600, env=env)
    assert len(train_rows(killed)) < 3
    rltrain(*args, run_dir=killed, env=env, timeout=600)
    resumed = read_metrics(killed)
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3]
    assert comparable(resumed) == comparable(read_metrics(whole))


def test_time_sharing_with_images_changes_no_number(shared_runs, image_data, tmp_path):
    plain = train_rows(shared_runs.get(*grpo_vision_run(image_data), env=reward_env(image_data), timeout=600))
    run_dir = tmp_path / "shared"
    rltrain(*grpo_vision_run(image_data), "placement.time_sharing=true", run_dir=run_dir, env=reward_env(image_data),
            timeout=600)
    shared = train_rows(run_dir)
    assert [(r["loss"], r["reward/mean"], r["grad_norm"]) for r in shared] == [
        (r["loss"], r["reward/mean"], r["grad_norm"]) for r in plain
    ]
    for row in shared:
        assert row["rollout/logprob_diff_max"] < 1e-3, row
        assert all(row[f"time/phase/{phase}"] >= 0.0 for phase in PHASES), row


def test_a_reward_model_trained_on_images_scores_a_grpo_run(tiny_cache, image_data, tmp_path):
    """`+experiment=rm_then_ppo`'s two commands on images: algo=rm, then an RL run scored by its final/.
    The RL run reads parquet in the datasets Image layout (image bytes, `data.columns.images=img`), and
    a reward function beside the model gets both image columns as each row's PIL images in its worker
    (it raises on anything else, which would stop the run)."""
    import json

    rm_dir = tmp_path / "rm"
    data = image_data / "pref.jsonl"
    rltrain("algo=rm", "model=tiny_vl", f"data.path={data}", f"data.eval_path={data}", "data.num_eval=4",
            "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.eval_every=2",
            "trainer.save_every=0", "optim.lr=1e-2", "logger.wandb.mode=disabled", run_dir=rm_dir, timeout=400)
    rows = train_rows(rm_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    assert any("eval/rm_accuracy" in r for r in read_metrics(rm_dir))
    final = rm_dir / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["rltrain_reward_head"] == "score.safetensors" and (final / "score.safetensors").is_file()
    assert (final / "preprocessor_config.json").is_file() or (final / "processor_config.json").is_file()

    grpo_dir = tmp_path / "grpo"
    rltrain("algo=grpo", "model=tiny_vl", "rollout=hf", f"data.path={image_data / 'prompts_image_layout.parquet'}",
            "data.columns.images=img", "reward.fns=[sees_images_reward:sees_the_images]", "reward_model=hf",
            f"reward_model.path={final}", "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2",
            "trainer.eval_every=0", "data.num_eval=2", "logger.wandb.mode=disabled", run_dir=grpo_dir,
            env=reward_env(image_data), timeout=400)
    grpo_rows = train_rows(grpo_dir)
    assert len(grpo_rows) == 2
    assert all(math.isfinite(r["reward/model"]) and r["reward/model"] != 0.0 for r in grpo_rows)
    assert all(r["reward/sees_the_images"] == 1.0 and r["reward/errors"] == 0.0 for r in grpo_rows), grpo_rows
