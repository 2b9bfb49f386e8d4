"""Hydra multiruns that survive a failed job (issue 14, point 1): every job runs, the sweep dir
gets `sweep_summary.csv`, the process exits non-zero after the last job when one failed, and the
process-global state of a job (megatron's parallel state among it) is reset for the next."""

from __future__ import annotations

import csv
import textwrap

import pytest
from cli import QUICK, rltrain, train_rows

pytestmark = pytest.mark.e2e


def _summary(sweep) -> list[dict]:
    with open(sweep / "sweep_summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_grpo_sweep_reports_a_failed_job_and_runs_the_next(tiny_cache, tmp_path):
    (tmp_path / "rw_sweep.py").write_text(textwrap.dedent("""
        def broken(prompts, completions, **_):
            raise ValueError("broken on purpose")
    """))
    sweep = tmp_path / "sweep"
    # Job 0 fails mid-run (its reward raises at step 1, after the engines were built); job 1 must
    # still start, in the same process, and finish.
    proc = rltrain(
        "-m", "algo=grpo", "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=2", "data.num_eval=4",
        "reward.fns=[rw_sweep:broken],[rltrain.rewards.builtin:addition_reward]", *QUICK, f"hydra.sweep.dir={sweep}",
        env={"PYTHONPATH": str(tmp_path)}, check=False, timeout=400,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]  # the failed job's status, after every job ran
    rows = _summary(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    failed, ok = rows
    assert (failed["status"], failed["exit_status"]) == ("failed", "2")
    assert "rw_sweep:broken" in failed["error"] and "broken on purpose" in failed["error"]
    assert "rw_sweep" in failed["overrides"] and failed["loss"] == ""
    assert (ok["status"], ok["exit_status"], ok["error"]) == ("ok", "0", "")
    assert float(ok["reward/mean"]) >= 0.0 and ok["loss"] != ""
    assert len(train_rows(sweep / "1")) == 2 and (sweep / "1" / "final" / "model.safetensors").exists()
    assert not (sweep / "1" / "plots.png").exists()  # logger.plot=false (QUICK)
    assert "sweep summary (2 jobs, 1 failed" in proc.stdout
    assert proc.stderr.count("broken on purpose") == 1  # the job's paragraph, once


def test_megatron_sweep_runs_every_job_in_one_process(tiny_cache, tmp_path):
    sweep = tmp_path / "sweep"
    proc = rltrain(
        "-m", "algo=sft", "backend=megatron", "optim.lr=1e-3,2e-3", "trainer.max_steps=2", *QUICK,
        f"hydra.sweep.dir={sweep}", timeout=400,
    )
    rows = _summary(sweep)
    assert [(r["job"], r["status"], r["exit_status"]) for r in rows] == [("0", "ok", "0"), ("1", "ok", "0")], proc.stdout[-2000:]
    for job in ("0", "1"):
        assert len(train_rows(sweep / job)) == 2
        assert (sweep / job / "final" / "model.safetensors").exists()
    # Same data and seed, different learning rates: the second job really trained anew.
    assert float(rows[0]["loss"]) != float(rows[1]["loss"])
