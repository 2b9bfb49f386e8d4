"""W&B shows what the model wrote (issue 15, point 7): a table of prompts, completions and rewards
at every evaluation (`samples/eval`) and every `logger.sample_every` GRPO steps (`samples/train`),
read back from the offline run's own files."""

from __future__ import annotations

import pytest
from cli import DPO_RUN, SFT_RUN, read_metrics, rltrain
from wandb_reader import find_run_file, read_offline_run, read_table

pytestmark = pytest.mark.e2e

COLUMNS = ["step", "prompt", "completion", "reward"]


def _tables(run_dir, key: str) -> dict[int, dict]:
    run_file = find_run_file(run_dir)
    history = read_offline_run(run_file)["history"]
    return {step: read_table(run_file, row, key) for step, row in sorted(history.items()) if f"{key}/_type" in row}


def _evals(run_dir, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_greedy_completions_are_logged_at_every_evaluation(shared_runs, algo):
    # The shared runs: 6 steps, trainer.eval_every=3, data.num_eval=8, W&B offline.
    run_dir = shared_runs.get(*{"sft": SFT_RUN, "dpo": DPO_RUN}[algo])
    tables = _tables(run_dir, "samples/eval")
    accuracy = _evals(run_dir, "eval/accuracy")
    assert sorted(tables) == sorted(accuracy) == [0, 3, 6]
    assert not _tables(run_dir, "samples/train")
    for step, table in tables.items():
        assert table["columns"] == COLUMNS and len(table["data"]) == 8  # every held-out prompt (one rank)
        assert all(row[0] == step and row[1].endswith("=") and row[3] in (0.0, 1.0) for row in table["data"])
        # The reward is the exact-match verdict: its mean is the logged accuracy.
        assert sum(row[3] for row in table["data"]) / 8 == pytest.approx(accuracy[step])


def test_grpo_logs_rollouts_every_sample_every_steps_and_at_evaluation(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=grpo", "model=tiny", "rollout=hf", "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=2",
            "logger.sample_every=2", "trainer.eval_every=0", "trainer.save_every=0", "data.num_eval=8",
            "logger.wandb.mode=offline", "trainer.progress=lines", run_dir=run_dir, timeout=400)
    train = _tables(run_dir, "samples/train")
    assert sorted(train) == [2]  # step 2 only: logger.sample_every=2
    rows = train[2]["data"]
    assert train[2]["columns"] == COLUMNS and len(rows) == 16  # 4 prompts x 4 completions
    assert [row[1] for row in rows] == [p for p in dict.fromkeys(row[1] for row in rows) for _ in range(4)]  # groups
    reward_mean = {r["step"]: r["reward/mean"] for r in read_metrics(run_dir) if "reward/mean" in r}
    assert sum(row[3] for row in rows) / 16 == pytest.approx(reward_mean[2])
    evals = _tables(run_dir, "samples/eval")
    assert sorted(evals) == [2] and len(evals[2]["data"]) == 8
    assert sum(row[3] for row in evals[2]["data"]) / 8 == pytest.approx(_evals(run_dir, "eval/reward")[2])
