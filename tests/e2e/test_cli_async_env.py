"""Multi-turn episodes generated ahead (`env=python` with `placement.max_staleness=1`, docs/async.md):
GRPO on two FSDP ranks plays examples/higher_lower.py with vLLM in its own process.

- Every step's batch, every turn of every episode, is sampled by version max(0, t - 1 - k) exactly
  (`batches.jsonl`'s `sampled_by`, `rollout/staleness_*`); parity holds on the same-version step
  over every sampled token of every turn, the off-policy gap is reported on the others; the episode
  metrics are logged; the prompts are a synchronous run's, step for step.
- SIGKILL after the first checkpoint (a played batch of the older version in flight, and the
  prompts of the one the checkpoint's weights replay) and a restart reproduce the uninterrupted run
  row for row and batch for batch.
- The same with env=agent (examples/openai_agent.py, one episode at a time so that a run is
  reproducible): the played agent batch in the checkpoint (every sequence, the episode of each)
  trains after a SIGKILL exactly as in the uninterrupted run.
"""

from __future__ import annotations

import json
import signal

import pytest
from cli import ROOT, SMALL_MODEL, comparable, kill_when, read_metrics, rltrain, train_rows

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("separate_engine")]

STEPS = 3
K = 1
EXAMPLES = {"PYTHONPATH": str(ROOT / "examples")}
SYNC_RUN = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, "env=python", "env.cls=higher_lower:HigherLower", "env.max_turns=3",
    "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=4", f"trainer.max_steps={STEPS}", "trainer.eval_every=2",
    "trainer.save_every=1", "trainer.progress=lines", "trainer.nproc=2", "logger.wandb.mode=disabled",
    "rollout=vllm", "rollout.process=separate",
]
ASYNC_RUN = [*SYNC_RUN, f"placement.max_staleness={K}"]


@pytest.fixture
def async_env_run(shared_runs):
    return shared_runs.get(*ASYNC_RUN, timeout=600, env=EXAMPLES)


def batches(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]


def test_every_episode_of_a_batch_is_sampled_by_its_scheduled_version(async_env_run, tmp_path):
    rows = train_rows(async_env_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        t = r["step"]
        assert r["rollout/staleness_mean"] == r["rollout/staleness_max"] == min(t - 1, K), r
        assert 1.0 < r["env/turns_mean"] <= 3.0 and r["env/timeouts"] == r["env/errors"] == 0.0, r
        assert "reward/env" in r and r["reward/mean"] == pytest.approx(r["reward/env"]), r
        if t == 1:  # the trainer's own weights sampled every turn: parity over every sampled token
            assert r["rollout/logprob_diff_max"] < 1e-3 and "rollout/offpolicy_diff_max" not in r, r
        else:
            assert "rollout/logprob_diff_max" not in r and r["rollout/offpolicy_diff_max"] > 0, r
    ledger = batches(async_env_run)
    assert [(b["step"], b["sampled_by"]) for b in ledger] == [(t, max(0, t - 1 - K)) for t in range(1, STEPS + 1)]
    evals = [r for r in read_metrics(async_env_run) if "eval/reward" in r]
    assert evals and all(0.0 <= r["eval/success"] <= 1.0 for r in evals)
    # The prompts of a synchronous run, step for step; its first step (the same version, the same
    # seeds) plays the very same episodes.
    sync_dir = tmp_path / "sync"
    rltrain(*SYNC_RUN, "trainer.max_steps=1", "trainer.save_every=0", run_dir=sync_dir, timeout=600, env=EXAMPLES)
    assert [b["prompts"] for b in batches(sync_dir)] == [ledger[0]["prompts"]]
    first_sync, first_async = train_rows(sync_dir)[0], rows[0]
    for key in ("reward/mean", "env/turns_mean", "env/success", "rollout/response_length_mean"):
        assert first_sync[key] == first_async[key], key


@pytest.mark.slow  # minutes on 2 cores; the single-turn kill-and-resume test holds the mechanism in `make test`
def test_sigkill_after_a_checkpoint_resumes_multi_turn_async_to_the_uninterrupted_run(async_env_run, tmp_path):
    run_dir = tmp_path / "killed"
    kill_when(ASYNC_RUN, run_dir, run_dir / "checkpoints" / "step_00000001", signal.SIGKILL, timeout=600, env=EXAMPLES)
    assert len(train_rows(run_dir)) < STEPS
    rltrain(*ASYNC_RUN, run_dir=run_dir, timeout=600, env=EXAMPLES)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, STEPS + 1))
    assert comparable(resumed) == comparable(read_metrics(async_env_run))
    assert batches(run_dir) == batches(async_env_run)


# One episode in flight at a time: each call is its own engine call, seeded by the phase's own
# calls, so the run is reproducible (docs/agents.md, "Reproducibility") and a resume comparable.
AGENT_RUN = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, "env=agent", "env.agent=openai_agent:run", "env.workers=1", "env.max_concurrency=1",
    "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=4", f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "trainer.save_every=1",
    "trainer.progress=lines", "logger.wandb.mode=disabled", "rollout=vllm", "rollout.process=separate", f"placement.max_staleness={K}",
]


@pytest.mark.slow  # three runs with a vLLM process each; the schedule of env=agent ahead is checked in test_cli_server.py
def test_sigkill_after_a_checkpoint_resumes_async_agents_to_the_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    rltrain(*AGENT_RUN, run_dir=whole, timeout=600, env=EXAMPLES)
    rows = train_rows(whole)
    assert [(r["step"], r["rollout/staleness_max"]) for r in rows] == [(t, min(t - 1, K)) for t in range(1, STEPS + 1)]
    assert all(r["env/errors"] == r["env/timeouts"] == 0.0 and r["env/turns_mean"] >= 1.0 for r in rows), rows
    run_dir = tmp_path / "killed"
    kill_when(AGENT_RUN, run_dir, run_dir / "checkpoints" / "step_00000001", signal.SIGKILL, timeout=600, env=EXAMPLES)
    assert len(train_rows(run_dir)) < STEPS
    rltrain(*AGENT_RUN, run_dir=run_dir, timeout=600, env=EXAMPLES)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed if "loss" in r] == list(range(1, STEPS + 1))
    assert comparable(resumed) == comparable(read_metrics(whole))
    assert batches(run_dir) == batches(whole)
