"""The sweep summary's rows, CSV and table (rltrain.launch.sweep), and the reset of process-global state
between in-process jobs (rltrain.runtime.process_state)."""

from __future__ import annotations

import csv
import json
import os

import pytest

from rltrain.launch.sweep import COLUMNS, JobOutcome, format_table, objective_value, row, write_summary
from rltrain.runtime.process_state import environment_snapshot, reset_process_state, restore_environment


def test_rows_carry_the_final_metrics_and_write_a_csv(tmp_path):
    run = tmp_path / "0"
    run.mkdir()
    lines = [{"step": 1, "loss": 2.0, "reward/mean": 0.1}, {"step": 2, "loss": 1.5, "reward/mean": 0.3}, {"step": 2, "eval/reward": 0.4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "lo')  # torn tail
    ok = row(0, ["algo=grpo", "optim.lr=1"], run, JobOutcome("ok", 0, objective=0.3))
    bad = row(1, ["algo=grpo", "optim.lr=2"], tmp_path / "1", JobOutcome("failed", 2, "boom"))
    assert (ok["loss"], ok["reward/mean"], ok["eval/reward"], ok["objective"]) == (1.5, 0.3, 0.4, 0.3)
    assert bad["loss"] == "" and bad["error"] == "boom"
    path = write_summary(tmp_path, [ok, bad])
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == list(COLUMNS)
    assert (got[1]["status"], got[1]["exit_status"], got[1]["error"], got[1]["objective"]) == ("failed", "2", "boom", "")
    table = format_table([ok, bad])
    assert "optim.lr=1" in table and "algo=grpo" not in table  # only what the sweep varied
    assert "boom" in table and "eval/accuracy" not in table  # empty columns left out


def test_objective_averages_the_last_finite_values(tmp_path):
    lines = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval/accuracy": 0.5}, {"step": 3, "loss": "nan"}, {"step": 4, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert objective_value(tmp_path, "loss", 1) == 1.0
    assert objective_value(tmp_path, "loss", 2) == 1.5  # the logged "nan" does not count
    assert objective_value(tmp_path, "loss", 10) == pytest.approx(7 / 3)
    assert objective_value(tmp_path, "eval/accuracy", 3) == 0.5
    assert objective_value(tmp_path, "reward/mean", 1) is None


def test_the_float_of_an_outcome_is_its_objective_or_a_value_error():
    assert float(JobOutcome("ok", 0, objective=0.25, objective_key="loss")) == 0.25
    with pytest.raises(ValueError, match="boom"):
        float(JobOutcome("failed", 2, "boom"))
    with pytest.raises(ValueError, match="'reward/mean'"):
        float(JobOutcome("ok", 0, objective_key="reward/mean"))


def test_process_state_is_reset(monkeypatch):
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    assert torch.are_deterministic_algorithms_enabled()
    reset_process_state()
    assert not torch.are_deterministic_algorithms_enabled()

    monkeypatch.setenv("RLTRAIN_TEST_KEPT", "a")
    snap = environment_snapshot()
    os.environ["RLTRAIN_TEST_LEAK"] = "1"
    os.environ["RLTRAIN_TEST_KEPT"] = "changed"
    restore_environment(snap)
    assert "RLTRAIN_TEST_LEAK" not in os.environ and os.environ["RLTRAIN_TEST_KEPT"] == "a"
