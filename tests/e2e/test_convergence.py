"""The embedded default learns: each algorithm's default command reaches its target.

These are the product's headline promises, run exactly as a new user types them (only the run
directory and W&B mode are set). They take a few minutes each on two cores.
"""

from __future__ import annotations

import statistics

import pytest
from cli import read_metrics, rltrain, train_rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sft_default_reaches_heldout_accuracy(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=sft", "logger.wandb.mode=disabled", run_dir=run_dir, timeout=600)
    final = [r for r in read_metrics(run_dir) if "eval/accuracy" in r][-1]
    assert final["eval/accuracy"] >= 0.8


def test_dpo_default_reaches_heldout_preference_accuracy(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=dpo", "logger.wandb.mode=disabled", run_dir=run_dir, timeout=600)
    evals = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r]
    assert evals[-1]["eval/dpo_accuracy"] >= 0.9
    assert "eval/accuracy" in evals[0] and "eval/accuracy" in evals[-1]


def test_grpo_default_raises_the_reward(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("logger.wandb.mode=disabled", run_dir=run_dir, timeout=600)  # algo=grpo is the default
    rewards = [r["reward/mean"] for r in train_rows(run_dir)]
    assert statistics.mean(rewards[-10:]) - statistics.mean(rewards[:10]) >= 0.2
