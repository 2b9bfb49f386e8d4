"""The sweep summary's rows, CSV and table (rltrain.sweep), and the reset of process-global state
between in-process jobs (rltrain.process_state)."""

from __future__ import annotations

import csv
import json
import os

from rltrain.process_state import environment_snapshot, reset_process_state, restore_environment
from rltrain.sweep import COLUMNS, format_table, row, write_summary


def test_rows_carry_the_final_metrics_and_write_a_csv(tmp_path):
    run = tmp_path / "0"
    run.mkdir()
    lines = [{"step": 1, "loss": 2.0, "reward/mean": 0.1}, {"step": 2, "loss": 1.5, "reward/mean": 0.3}, {"step": 2, "eval/reward": 0.4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "lo')  # torn tail
    ok = row(0, ["algo=grpo", "optim.lr=1"], run, {"status": "ok", "exit_status": 0, "error": ""})
    bad = row(1, ["algo=grpo", "optim.lr=2"], tmp_path / "1", {"status": "failed", "exit_status": 2, "error": "boom"})
    assert (ok["loss"], ok["reward/mean"], ok["eval/reward"]) == (1.5, 0.3, 0.4)
    assert bad["loss"] == "" and bad["error"] == "boom"
    path = write_summary(tmp_path, [ok, bad])
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == list(COLUMNS)
    assert (got[1]["status"], got[1]["exit_status"], got[1]["error"]) == ("failed", "2", "boom")
    table = format_table([ok, bad])
    assert "optim.lr=1" in table and "algo=grpo" not in table  # only what the sweep varied
    assert "boom" in table and "eval/accuracy" not in table  # empty columns left out


def test_process_state_is_reset(monkeypatch):
    from rltrain.safety import faults

    faults.install("loss_error:0:1", 0)
    assert faults.active().faults
    reset_process_state()
    assert not faults.active().faults

    monkeypatch.setenv("RLTRAIN_TEST_KEPT", "a")
    snap = environment_snapshot()
    os.environ["RLTRAIN_TEST_LEAK"] = "1"
    os.environ["RLTRAIN_TEST_KEPT"] = "changed"
    restore_environment(snap)
    assert "RLTRAIN_TEST_LEAK" not in os.environ and os.environ["RLTRAIN_TEST_KEPT"] == "a"
