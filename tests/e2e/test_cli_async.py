"""Generating ahead (`placement.max_staleness`, docs/async.md) in real 2-rank runs: GRPO on FSDP
with k = 1, PPO on Megatron tensor parallel (tp = 2, one replica whose leader generates) with k = 2,
both with vLLM in its own process.

- Every step's batch is sampled by version max(0, t - 1 - k) exactly (`batches.jsonl`'s
  `sampled_by`, `rollout/staleness_*`), on the prompts a synchronous run takes, none twice; the waits and the correction's
  metrics are logged, parity is measured on the same-version step and the off-policy gap on the others.
- SIGKILL between checkpoints and a restart reproduce the uninterrupted run row for row, and the
  same prompts step for step (the checkpoint holds the batches in flight): on the PPO/Megatron k = 2
  run, whose checkpoints hold two batches in flight.
"""

from __future__ import annotations

import json
import signal

import pytest
from cli import GRPO_RUN_2_RANKS, SMALL_MODEL, comparable, kill_when, read_metrics, rltrain, train_rows

# One xdist worker runs every separate-engine test: their cleanup checks count rlsep-* directories.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("separate_engine")]

STEPS = 5
COMMON = [
    "model=tiny", *SMALL_MODEL, "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=8", "data.eval_seed=0",
    f"trainer.max_steps={STEPS}", "trainer.save_every=2", "trainer.eval_every=3", "trainer.progress=lines",
    "trainer.nproc=2", "logger.wandb.mode=disabled", "rollout=vllm", "rollout.process=separate",
]
RUNS = {
    "grpo-fsdp-k1": (1, ["algo=grpo", *COMMON, "placement.max_staleness=1"]),
    "ppo-megatron-tp2-k2": (2, ["algo=ppo", *COMMON, "model.num_kv_heads=2", "backend=megatron", "backend.tp=2", "placement.max_staleness=2"]),
}


@pytest.fixture(params=sorted(RUNS))
def async_run(request, shared_runs):
    """(k, args, run directory) of the uninterrupted run: a shared run, so it happens once per
    session whichever worker and test ask for it first."""
    k, args = RUNS[request.param]
    return k, args, shared_runs.get(*args, timeout=600)


def batches(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]


def test_each_batch_is_sampled_by_its_scheduled_version(async_run, shared_runs):
    k, _, run_dir = async_run
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        t = r["step"]
        assert r["rollout/staleness_mean"] == r["rollout/staleness_max"] == min(t - 1, k), r
        assert r["time/wait_rollout"] >= 0 and r["time/wait_train"] >= 0, r
        assert 0 < r["rollout/is_weight_mean"] <= 2.0 and r["rollout/masked_frac"] == 0.0, r  # tis, capped at 2
        if t == 1:  # sampled by the trainer's own weights: parity holds and is checked
            assert r["rollout/logprob_diff_max"] < 1e-3 and "rollout/offpolicy_diff_max" not in r, r
        else:  # the gap to an older version is reported as what it is
            assert "rollout/logprob_diff_max" not in r and r["rollout/offpolicy_diff_max"] > 0, r
    ledger = batches(run_dir)
    assert [(b["step"], b["sampled_by"]) for b in ledger] == [(t, max(0, t - 1 - k)) for t in range(1, STEPS + 1)]
    prompts = [p for b in ledger for p in b["prompts"]]
    assert all(len(b["prompts"]) == 4 for b in ledger) and len(set(prompts)) == len(prompts)
    # The prompts of a synchronous run of the same data, step for step (its versions: the trainer's own).
    sync = batches(shared_runs.get(*GRPO_RUN_2_RANKS))
    assert [(b["step"], b["sampled_by"]) for b in sync] == [(1, 0), (2, 1)]
    assert [b["prompts"] for b in sync] == [b["prompts"] for b in ledger[:2]]


def test_sigkill_between_checkpoints_resumes_to_the_uninterrupted_run(shared_runs, tmp_path):
    """On the configuration with the most in flight (k = 2: two batches of older versions in the
    checkpoint, the replica leader's); the checkpointed batches are per rank and backend-blind."""
    _, args = RUNS["ppo-megatron-tp2-k2"]
    full = shared_runs.get(*args, timeout=600)
    run_dir = tmp_path / "killed"
    kill_when(args, run_dir, run_dir / "checkpoints" / "step_00000002", signal.SIGKILL, timeout=600)
    assert len(train_rows(run_dir)) < STEPS
    rltrain(*args, run_dir=run_dir, timeout=600)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, STEPS + 1))
    assert comparable(resumed) == comparable(read_metrics(full))
    assert batches(run_dir) == batches(full)
