"""scripts/bench_vlm.py at the smallest sizes, so it cannot rot between benchmark runs: a row per
rltrain rollout engine, and TRL's row beside them wherever TRL is importable (it is a benchmark
peer, not a dependency: without it the script says so and prints rltrain's rows alone). Timings
are printed, never asserted."""

from __future__ import annotations

import importlib.util

import pytest
from cli import python

pytestmark = pytest.mark.e2e

COLUMNS = 7  # tokens/s, step s, rollout s, train s, completion len, peak GiB, tokens/s vs TRL


def test_bench_vlm_prints_a_row_per_rollout_engine_and_trl_beside_them_when_importable():
    proc = python("scripts/bench_vlm.py", "--steps", "1", "--warmup", "0", "--prompts", "2", "--group", "2",
                  "--max-new-tokens", "4", "--image-size", "28", timeout=600, warm=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.rsplit(None, COLUMNS)[0]: line.rsplit(None, COLUMNS)[1:] for line in proc.stdout.splitlines()
            if line.startswith(("rltrain GRPO", "TRL GRPOTrainer"))}
    ours = ["rltrain GRPO (rollout=vllm)", "rltrain GRPO (rollout=hf)"]
    for name in ours:
        tokens_per_s, step_s, rollout_s, train_s, length, peak_gib = map(float, rows[name][:6])
        assert tokens_per_s > 0 and step_s > 0 and rollout_s > 0 and train_s > 0 and peak_gib > 0, rows[name]
        assert 0 < length <= 4, rows[name]  # at most --max-new-tokens sampled
    if importlib.util.find_spec("trl") is None:
        assert list(rows) == ours, proc.stdout
        assert "TRL is not importable: install trl==1.16.0 to compare" in proc.stdout
        assert all(rows[name][-1] == "-" for name in ours), proc.stdout
    else:
        assert list(rows) == [*ours, "TRL GRPOTrainer (use_vllm=False)"], proc.stdout
        assert rows["TRL GRPOTrainer (use_vllm=False)"][-1] == "1.00x" and float(rows["TRL GRPOTrainer (use_vllm=False)"][0]) > 0
        assert all(float(rows[name][-1].rstrip("x")) > 0 for name in ours), proc.stdout
        assert proc.stdout.count("paired per-step speed-up of rltrain GRPO") == 2, proc.stdout


def test_bench_vlm_names_an_unknown_rollout_engine():
    proc = python("scripts/bench_vlm.py", "--rollout", "vllm,sglang", timeout=120, warm=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--rollout vllm,sglang: choose from vllm,hf, comma-separated" in proc.stderr, proc.stderr
