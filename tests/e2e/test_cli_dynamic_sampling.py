"""DAPO's dynamic sampling (`algo.dynamic_sampling=true`) in real GRPO runs, with a reward whose
signal is known per prompt: a group carries signal exactly when its prompt's first operand is even
(its first completion scores 1, the others 0), otherwise every completion scores 0.

- Each step trains on the first groups with signal, in as many rounds as it needs (at most
  `algo.max_sampling_rounds`), fills a short batch with groups without signal, and says so in
  `rollout/sampling_rounds`, `rollout/groups_dropped`, `rollout/groups_without_signal`.
- A run stopped after a checkpoint resumes to the uninterrupted run's rows.
- Generating ahead, every round of a batch is sampled by the batch's one scheduled version.
"""

from __future__ import annotations

import json
import shutil

import pytest
from cli import SMALL_MODEL, comparable, copy_run, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

REWARD = '''
def even_first_operand(prompts, completions, **_):
    """One prompt's group per call (reward.chunk_size=0): its first completion scores 1 where the
    prompt's first operand is even, so exactly those groups carry signal."""
    even = int(prompts[0].split("+")[0]) % 2 == 0
    return [1.0 if (i == 0 and even) else 0.0 for i in range(len(completions))]
'''
PROMPTS, GROUP, ROUNDS, STEPS = 4, 2, 3, 3
ARGS = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, f"algo.prompts_per_step={PROMPTS}", f"algo.group_size={GROUP}",
    "algo.dynamic_sampling=true", f"algo.max_sampling_rounds={ROUNDS}", "reward.fns=[ds_reward:even_first_operand]",
    f"trainer.max_steps={STEPS}", "trainer.save_every=2", "trainer.eval_every=0", "trainer.log_every=1",
    "trainer.progress=lines", "logger.wandb.mode=disabled",
]


@pytest.fixture
def reward_env(tmp_path) -> dict:
    (tmp_path / "ds_reward.py").write_text(REWARD)
    return {"PYTHONPATH": str(tmp_path)}


def batches(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]


def test_rounds_keep_the_groups_with_signal_and_a_stopped_run_resumes_to_the_same_rows(tmp_path, reward_env):
    whole = tmp_path / "whole"
    rltrain(*ARGS, run_dir=whole, env=reward_env, timeout=400)
    rows = train_rows(whole)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ledger = batches(whole)
    for r, b in zip(rows, ledger, strict=True):
        rounds, dropped, filled = r["rollout/sampling_rounds"], r["rollout/groups_dropped"], r["rollout/groups_without_signal"]
        assert 1 <= rounds <= ROUNDS and len(b["prompts"]) == PROMPTS * rounds, (r, b)
        # Every group sampled is kept, dropped or used to fill; a fill only when the rounds ran out.
        assert (PROMPTS - filled) + dropped + filled == PROMPTS * rounds
        assert filled == 0 or rounds == ROUNDS
        # Each group with signal contributes exactly one reward of 1; filled groups none.
        assert r["reward/mean"] == pytest.approx((PROMPTS - filled) / (PROMPTS * GROUP))
    prompts = [p for b in ledger for p in b["prompts"]]
    assert len(set(prompts)) == len(prompts)  # no prompt taken twice
    assert sum(r["rollout/sampling_rounds"] for r in rows) > STEPS  # this data needs extra rounds

    resumed = copy_run(whole, tmp_path / "resumed")
    shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS:08d}")
    shutil.rmtree(resumed / "final")
    for name in ("metrics.jsonl", "batches.jsonl"):
        path = resumed / name
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= 2]
        path.write_text("".join(line + "\n" for line in kept))
    proc = rltrain(*ARGS, run_dir=resumed, env=reward_env, timeout=400)
    assert "step_00000002 (step 2)" in proc.stdout
    assert comparable(train_rows(resumed)) == comparable(rows)
    assert batches(resumed) == ledger


def test_generating_ahead_samples_every_round_of_a_batch_with_its_scheduled_version(tmp_path, reward_env):
    run_dir = tmp_path / "ahead"
    k = 1
    rltrain(
        *ARGS, "rollout=vllm", "rollout.process=separate", f"placement.max_staleness={k}", "trainer.save_every=0",
        run_dir=run_dir, env=reward_env, timeout=400,
    )
    rows, ledger = train_rows(run_dir), batches(run_dir)
    assert [(b["step"], b["sampled_by"]) for b in ledger] == [(t, max(0, t - 1 - k)) for t in range(1, STEPS + 1)]
    # Every round a step may need is taken with its batch and sampled by the batch's version.
    assert all(len(b["prompts"]) == PROMPTS * ROUNDS for b in ledger)
    for r in rows:
        assert r["rollout/staleness_max"] == min(r["step"] - 1, k)
        assert r["reward/mean"] == pytest.approx((PROMPTS - r["rollout/groups_without_signal"]) / (PROMPTS * GROUP))
    assert read_metrics(run_dir)[-1]["step"] == STEPS
