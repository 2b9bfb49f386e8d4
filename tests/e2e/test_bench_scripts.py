"""The GPU benchmark also runs on CPU (small model), so it cannot rot between GPU sessions; its
TRL side is run too wherever TRL is importable (it is not a dependency, so CI skips that test)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli import ROOT, python
from helpers import free_port

pytestmark = pytest.mark.e2e


def test_bench_gpu_runs_every_workload_on_cpu():
    proc = python("scripts/bench_gpu.py", "--steps", "1", "--warmup", "0", "--batch", "4", "--micro", "2",
                  "--group", "2", "--no-trl", "--port", str(free_port()), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in proc.stdout.splitlines() if line.startswith("rltrain ")}
    assert set(rows) == {"sft", "dpo", "grpo"}, proc.stdout
    for name, cells in rows.items():
        assert float(cells[2]) > 0 and float(cells[3].rstrip("%")) > 0, (name, cells)


def test_bench_gpu_names_an_unknown_workload_before_building_anything():
    proc = python("scripts/bench_gpu.py", "--only", "sft,ppo", "--no-trl", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unknown workload(s) ppo; choose from sft,dpo,grpo" in proc.stderr, proc.stderr


def test_bench_gpu_prints_trl_beside_every_workload_when_trl_is_importable():
    """TRL is a benchmark peer, not a dependency: this runs where it is importable (PYTHONPATH)."""
    pytest.importorskip("trl")
    proc = subprocess.run(
        [sys.executable, "scripts/bench_gpu.py", "--steps", "1", "--warmup", "0", "--batch", "4", "--micro", "2",
         "--group", "2", "--threads", "1", "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trl_rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("TRL 1.16 ")]
    assert [cells[2] for cells in trl_rows] == ["SFTTrainer", "DPOTrainer", "GRPOTrainer"], proc.stdout
    for cells in trl_rows:
        assert float(cells[-4]) > 0 and cells[-1] == "1.00x", cells
    ours = [line.split() for line in proc.stdout.splitlines() if line.startswith("rltrain ")]
    assert all(cells[-1].endswith("x") and float(cells[-1][:-1]) > 0 for cells in ours), proc.stdout
    assert "warning" not in proc.stdout, proc.stdout  # both sides counted the same tokens


def test_bench_rewards_prints_the_direct_call_and_the_pool():
    proc = python("scripts/bench_rewards.py", "--prompts", "2", "--group", "2", "--workers", "1", "--repeats", "1",
                  timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.rsplit(None, 1) for line in proc.stdout.splitlines()[2:]]
    assert [name for name, _ in rows] == ["direct call", "pool, 1 worker(s), a call per group"], proc.stdout
    assert all(float(ms) > 0 for _, ms in rows)
