"""Checkpoints defend themselves (docs/run-directory.md): keep_checkpoints >= 1, a torn or
corrupt newest checkpoint is reported and the previous one used, a foreign checkpoint is refused on
every rank, and DPO and GRPO resume after SIGKILL to exactly the uninterrupted rows, like SFT."""

from __future__ import annotations

import shutil
import signal

import pytest
from cli import QUICK, comparable, kill_when, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

SFT4 = [
    "algo=sft", "trainer.max_steps=4", "trainer.save_every=2", "trainer.global_batch_size=8",
    "logger.wandb.mode=disabled", "trainer.progress=lines",
]


def test_keep_checkpoints_below_one_is_refused_before_anything_runs(tmp_path):
    proc = rltrain("algo=sft", "trainer.keep_checkpoints=0", run_dir=tmp_path / "run", check=False, timeout=120)
    assert proc.returncode == 2
    assert "trainer.keep_checkpoints=0 must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def _corrupt_truncated(step_dir):
    shard = next((step_dir / "policy" / "engine").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])


def _corrupt_garbage_state(step_dir):
    (step_dir / "trainer_state.json").write_bytes(b"\x00garbage{")


def _corrupt_missing_engine(step_dir):
    shutil.rmtree(step_dir / "policy" / "engine")


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_garbage_state, _corrupt_missing_engine])
def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_resumes(tiny_cache, tmp_path, corrupt):
    rltrain(*SFT4, run_dir=tmp_path / "whole")
    run_dir = tmp_path / "run"
    rltrain(*SFT4, run_dir=run_dir)
    newest = run_dir / "checkpoints" / "step_00000004"
    corrupt(newest)
    proc = rltrain(*SFT4, run_dir=run_dir)
    assert f"checkpoint {newest} is torn or corrupt" in proc.stderr
    assert "step_00000002 (step 2)" in proc.stdout  # "resumed from ... (step 2)"
    assert (run_dir / "checkpoints" / "step_00000004.corrupt").exists()
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4]
    assert comparable(resumed) == comparable(read_metrics(tmp_path / "whole"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004", "step_00000004.corrupt",
    ]


def test_a_checkpoint_of_another_layout_is_refused_on_every_rank(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", "trainer.max_steps=2", "trainer.global_batch_size=8", *QUICK, run_dir=run_dir)
    proc = rltrain(
        "algo=sft", "trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.nproc=2", *QUICK,
        run_dir=run_dir, check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("rltrain: error:") == 1
    assert "world_size: checkpoint 1, this run 2" in proc.stderr
    assert "trainer.resume=never" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(train_rows(run_dir)) == 2  # nothing was trained or overwritten
    rltrain(
        "algo=sft", "trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.nproc=2", "trainer.resume=never",
        *QUICK, run_dir=run_dir,
    )
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3]


DPO = [
    "algo=dpo", "trainer.max_steps=6", "trainer.save_every=2", "trainer.eval_every=3", "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4", "data.num_eval=8", "logger.wandb.mode=disabled", "trainer.progress=lines",
]
GRPO = [
    "algo=grpo", "model=tiny", "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=4", "trainer.max_steps=4",
    "trainer.save_every=2", "trainer.eval_every=2", "logger.wandb.mode=disabled", "trainer.progress=lines",
]


@pytest.mark.parametrize(
    "common, kill_at",
    [(DPO, "step_00000004"), (GRPO, "step_00000002"), ([*GRPO, "rollout=hf"], "step_00000002")],
    ids=["dpo", "grpo-vllm", "grpo-hf"],
)
def test_killed_dpo_and_grpo_runs_resume_to_the_uninterrupted_result(tiny_cache, tmp_path, common, kill_at):
    rltrain(*common, run_dir=tmp_path / "whole", timeout=400)
    run_dir = tmp_path / "killed"
    kill_when(common, run_dir, run_dir / "checkpoints" / kill_at, signal.SIGKILL, timeout=400)
    steps = int(next(a for a in common if a.startswith("trainer.max_steps=")).split("=")[1])
    assert len(train_rows(run_dir)) < steps
    rltrain(*common, run_dir=run_dir, timeout=400)
    resumed, whole = read_metrics(run_dir), read_metrics(tmp_path / "whole")
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, steps + 1))
    assert comparable(resumed) == comparable(whole)
