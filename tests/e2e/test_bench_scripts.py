"""The GPU benchmark also runs on CPU (small model), so it cannot rot between GPU sessions."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli import ROOT

pytestmark = pytest.mark.e2e


def test_bench_gpu_runs_every_workload_on_cpu():
    proc = subprocess.run(
        [sys.executable, "scripts/bench_gpu.py", "--steps", "1", "--warmup", "0", "--batch", "4", "--micro", "2",
         "--group", "2", "--no-trl"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in proc.stdout.splitlines() if line.startswith("rltrain ")}
    assert set(rows) == {"sft", "dpo", "grpo"}, proc.stdout
    for name, cells in rows.items():
        assert float(cells[2]) > 0 and float(cells[3].rstrip("%")) > 0, (name, cells)


def test_bench_gpu_names_an_unknown_workload_before_building_anything():
    proc = subprocess.run(
        [sys.executable, "scripts/bench_gpu.py", "--only", "sft,ppo", "--no-trl"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unknown workload(s) ppo; choose from sft,dpo,grpo" in proc.stderr, proc.stderr
