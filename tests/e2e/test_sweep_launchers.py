"""Sweeps through Hydra's plugins (issue 15, points 3-5): a submitit sweep takes the code path a
Slurm sweep takes (every job pickled into a process of its own, each of its tasks one rank), and an
Optuna sweep reads each job's objective; in both a failed point is a row of the summary, not the
end of the sweep."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import yaml
from cli import QUICK, ROOT, CommandTimedOut, rltrain, train_rows
from PIL import Image

pytestmark = pytest.mark.e2e

SFT = ["algo=sft", "trainer.max_steps=2", "data.num_eval=8", *QUICK]


def _summary(sweep) -> list[dict]:
    with open(sweep / "sweep_summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def _task_logs(sweep) -> str:
    logs = sorted((sweep / ".submitit").glob("*/*_log.*"))
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in logs) or "no task logs"


# slow: submitit's rank wiring runs on real stores in tests/unit/launch/test_submitit_ranks.py and a sweep's
# failed point in test_sweep.py, both in make test.
@pytest.mark.slow
def test_submitit_sweep_of_two_rank_jobs_records_a_failed_point(tiny_cache, tmp_path):
    sweep = tmp_path / "sweep"
    # optim.lr=-1 fails validation in its job (a UserError, exit status 2); the other job trains.
    try:
        proc = rltrain(
            "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "optim.lr=1e-3,-1", *SFT,
            "safety.collective_timeout_s=120", f"hydra.sweep.dir={sweep}", check=False, timeout=400,
        )
    except CommandTimedOut as exc:  # the tasks write to their own logs, not the command's output
        raise AssertionError(_task_logs(sweep)) from exc
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _summary(sweep)
    assert [(r["job"], r["status"], r["exit_status"]) for r in rows] == [("0", "ok", "0"), ("1", "failed", "2")]
    ok, failed = rows
    assert "optim.lr=-1" in failed["overrides"] and "must be positive" in failed["error"] and failed["objective"] == ""
    # The default objective: the last eval/accuracy (the run evaluates at its last step).
    assert ok["objective"] != "" and float(ok["objective"]) == float(ok["eval/accuracy"])
    assert len(train_rows(sweep / "0")) == 2 and (sweep / "0" / "final" / "model.safetensors").exists()
    # Each job ran in submitit's processes, one per task, and the two tasks were two ranks of one run.
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 4
    assert sorted(p.name for p in (sweep / "0" / "heartbeats").iterdir()) == ["rank-0.json", "rank-1.json"]
    assert "sweep summary (2 jobs, 1 failed" in proc.stdout


def test_optuna_sweep_minimises_the_objective_and_survives_a_failed_trial(tiny_cache, tmp_path):
    sweep = tmp_path / "sweep"
    proc = rltrain(
        # TPE's first trials are seeded random draws: with seed 1 the three are -1, 0.001, 0.003.
        "-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.sampler.seed=1", "hydra.sweeper.n_trials=3",
        "hydra.sweeper.params={optim.lr:'choice(0.001,-1,0.003)'}",
        "sweep.objective=loss", "sweep.direction=minimize", "sweep.last_n=2", *SFT, "logger.plot=true",
        f"hydra.sweep.dir={sweep}", check=False, timeout=400,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # the failed trial's status
    rows = _summary(sweep)
    assert len(rows) == 3
    by_lr = {r["overrides"].split("optim.lr=")[1].split()[0]: r for r in rows}
    assert [r["overrides"].split("optim.lr=")[1].split()[0] for r in rows] == ["-1", "0.001", "0.003"]
    assert by_lr["-1"]["status"] == "failed" and by_lr["-1"]["objective"] == ""
    for lr in ("0.001", "0.003"):
        r = by_lr[lr]
        losses = [row["loss"] for row in train_rows(sweep / r["job"])]
        assert float(r["objective"]) == pytest.approx(sum(losses[-2:]) / 2, rel=1e-5)  # last_n=2 averaged
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = min(("0.001", "0.003"), key=lambda lr: float(by_lr[lr]["objective"]))
    assert results["best_params"] == {"optim.lr": float(best)}
    assert results["best_value"] == pytest.approx(float(by_lr[best]["objective"]), rel=1e-5)
    # Each finished run drew its own curves; the plot command draws the sweep's runs together.
    assert (sweep / "1" / "plots.png").exists() and not (sweep / "0" / "plots.png").exists()
    out = tmp_path / "sweep.png"
    plot = subprocess.run(
        [sys.executable, "-m", "rltrain.plot", str(sweep), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert plot.returncode == 0 and "2 runs" in plot.stdout, plot.stderr
    assert Image.open(out).size[0] > 1000
