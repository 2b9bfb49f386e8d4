"""Checkpoints defend themselves (docs/run-directory.md): keep_checkpoints >= 1, a torn or
corrupt newest checkpoint is reported and the previous one used, a foreign checkpoint is refused on
every rank, and DPO and GRPO resume after SIGKILL to exactly the uninterrupted rows, like SFT."""

from __future__ import annotations

import shutil
import signal

import pytest
from cli import (
    DPO_RUN,
    GRPO_HF_RUN,
    GRPO_RUN,
    SFT_RUN,
    comparable,
    copy_run,
    kill_when,
    read_metrics,
    rltrain,
    train_rows,
)

pytestmark = pytest.mark.e2e

# The damaged and resumed runs are private copies of the shared SFT run (tests/cli.py), which is
# also the uninterrupted run they are compared with. W&B changes no row, so the resumes skip it.
RESUME_SFT = [*SFT_RUN, "logger.wandb.mode=disabled"]


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


# Each damage is named by the check itself (tests/unit/run/test_checkpoint_defence.py); a resume past
# one of them, the torn shard, is in make test, the other two `slow`.
@pytest.mark.parametrize("corrupt", [
    _corrupt_truncated,
    pytest.param(_corrupt_garbage_state, marks=pytest.mark.slow),
    pytest.param(_corrupt_missing_engine, marks=pytest.mark.slow),
], ids=["truncated", "garbage_state", "missing_engine"])
def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_resumes(shared_runs, tmp_path, corrupt):
    whole = shared_runs.get(*SFT_RUN)
    run_dir = copy_run(whole, tmp_path / "run")
    newest = run_dir / "checkpoints" / "step_00000006"
    corrupt(newest)
    proc = rltrain(*RESUME_SFT, run_dir=run_dir)
    assert f"checkpoint {newest} is torn or corrupt" in proc.stderr
    assert "step_00000004 (step 4)" in proc.stdout  # "resumed from ... (step 4)"
    assert (run_dir / "checkpoints" / "step_00000006.corrupt").exists()
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert comparable(resumed) == comparable(read_metrics(whole))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000004", "step_00000006", "step_00000006.corrupt",
    ]


@pytest.mark.slow  # the fingerprint names each difference: tests/unit/run/test_checkpoint_defence.py, in make test
def test_a_checkpoint_of_another_layout_is_refused_on_every_rank(shared_runs, tmp_path):
    run_dir = copy_run(shared_runs.get(*SFT_RUN), tmp_path / "run")  # checkpoints of 1 rank, 6 steps
    two_ranks = [*RESUME_SFT, "trainer.max_steps=7", "trainer.nproc=2", "trainer.save_every=0"]
    proc = rltrain(*two_ranks, run_dir=run_dir, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("rltrain: error:") == 1
    assert "world_size: checkpoint 1, this run 2" in proc.stderr
    assert "trainer.resume=never" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(train_rows(run_dir)) == 6  # nothing was trained or overwritten
    rltrain(*two_ranks, "trainer.max_steps=3", "trainer.resume=never", run_dir=run_dir)
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3]


@pytest.mark.parametrize(
    "shared, kill_at, steps",
    # GRPO on the transformers engine is `slow`: what resumes (the prompt stream, the sampling seeds) is
    # the engine's caller's, the same as on vLLM. DPO is `slow`: what resumes (weights, optimizer, data
    # position) is the trainer's, as SFT's in test_cli_sft.py.
    [pytest.param(DPO_RUN, "step_00000002", 6, marks=pytest.mark.slow), (GRPO_RUN, "step_00000002", 4),
     pytest.param(GRPO_HF_RUN, "step_00000002", 4, marks=pytest.mark.slow)],
    ids=["dpo", "grpo-vllm", "grpo-hf"],
)
def test_killed_dpo_and_grpo_runs_resume_to_the_uninterrupted_result(shared_runs, tmp_path, shared, kill_at, steps):
    whole = shared_runs.get(*shared)
    common = [*shared, "logger.wandb.mode=disabled"]  # W&B changes no row
    run_dir = tmp_path / "killed"
    kill_when(common, run_dir, run_dir / "checkpoints" / kill_at, signal.SIGKILL, timeout=400)
    assert len(train_rows(run_dir)) < steps
    rltrain(*common, run_dir=run_dir, timeout=400)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, steps + 1))
    assert comparable(resumed) == comparable(read_metrics(whole))
