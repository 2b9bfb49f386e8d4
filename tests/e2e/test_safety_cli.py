"""Failure behaviour of real 2-rank runs, driven by `debug.fault` (docs/failure-behaviour.md)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cli import QUICK, ROOT, SMALL_MODEL, BackgroundRun, rltrain, train_rows

pytestmark = pytest.mark.e2e

TIMEOUT_S = 30  # safety.collective_timeout_s of these runs
SMALL = [
    "trainer.nproc=2",
    *SMALL_MODEL,
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "data.num_eval=4",
    f"safety.collective_timeout_s={TIMEOUT_S}",
]


def _deep(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/deep", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_recover_mode_completes_and_deep_health_reports_a_dead_rollout(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    run = BackgroundRun(["algo=sft", *QUICK, *SMALL, "trainer.max_steps=40", "health.port=0",
                         "debug.fault='loss_error:1:3,rollout_dead:0:15'"], run_dir)
    seen: list[tuple[int, dict]] = []
    try:
        deadline = time.monotonic() + 240
        while run.poll() is None and time.monotonic() < deadline:
            if (run_dir / "health.json").exists():
                try:
                    seen.append(_deep(json.loads((run_dir / "health.json").read_text())["port"]))
                except (OSError, ValueError):
                    pass  # the run finished between the check and the request
            time.sleep(0.1)
        proc = run.finish(timeout=240)
    finally:
        run.close()
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    rows = train_rows(run_dir)
    assert len(rows) == 40
    assert sum(r["safety/recovered_errors"] for r in rows) == 1 and rows[2]["safety/recovered_errors"] == 1
    assert "rltrain: rank 1: recovered from an error" in err and err.count("InjectedFault: loss_error") == 1
    codes = [code for code, _ in seen]
    assert 200 in codes and 503 in codes, codes
    assert codes.index(503) > codes.index(200)  # healthy first, unhealthy once the engine died
    body = next(b for c, b in seen if c == 503)
    assert any(d.startswith("rollout engine:") for d in body["dead"]) and set(body["ranks"]) == {"0", "1"}


def test_fail_fast_exits_non_zero_in_bounded_time_with_the_error(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = rltrain("algo=sft", *QUICK, *SMALL, "trainer.max_steps=5", "debug.fault=loss_error:1:2",
                   run_dir=run_dir, env={"RLTRAIN_FAIL_FAST": "1"}, check=False, timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120
    assert "InjectedFault: loss_error injected by debug.fault on rank 1 at step 2" in proc.stderr
    assert "raised on rank 1" in proc.stderr and "rank 1 exited with code 1" in proc.stderr
    assert not (run_dir / "final").exists()
    assert len(train_rows(run_dir)) == 1


def test_a_device_bug_in_the_loss_fails_a_recover_mode_run_at_once(tiny_cache, tmp_path):
    """A device mismatch is a bug, not a bad batch: recover mode re-raises it on the first step it
    happens, through the fail-fast path (the launcher stops the peer), with the first traceback."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = rltrain("algo=sft", *QUICK, *SMALL, "trainer.max_steps=5", "debug.fault=device_error:1:2",
                   run_dir=run_dir, env={"RLTRAIN_FAIL_FAST": "0"}, check=False, timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120
    assert "InjectedFault: Expected all tensors to be on the same device" in proc.stderr
    assert "not recovered (safety.fail_fast=false)" in proc.stderr and "rank 1 exited with code 1" in proc.stderr
    assert "recovered from an error" not in proc.stderr and proc.stderr.count("Traceback") >= 1
    assert not (run_dir / "final").exists()
    assert len(train_rows(run_dir)) == 1


def test_sigkill_of_a_rank_ends_the_job_in_bounded_time_naming_it(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = rltrain("algo=sft", *QUICK, *SMALL, "trainer.max_steps=5", "debug.fault=kill:1:2",
                   run_dir=run_dir, check=False, timeout=180)
    assert proc.returncode != 0
    assert "rank 1 exited with code -9 (killed by SIGKILL)" in proc.stderr, proc.stderr
    assert "rltrain: rank 0: a collective failed" in proc.stderr and "lost rank 1: process" in proc.stderr
    killed_at = json.loads((run_dir / "heartbeats" / "rank-1.json").read_text())["time"]
    survivor_done = (run_dir / "heartbeats" / "rank-0.json").stat().st_mtime
    assert survivor_done - killed_at < TIMEOUT_S + 30, "the survivor outlived the collective timeout + 30 s"
    assert os.path.exists(run_dir / "metrics.jsonl") and len(train_rows(run_dir)) == 1


def test_malformed_fault_is_a_user_error(tiny_cache, tmp_path):
    proc = rltrain("algo=sft", *QUICK, "debug.fault=explode:1:3", run_dir=tmp_path / "run", check=False, timeout=60)
    assert proc.returncode == 2 and "debug.fault='explode:1:3'" in proc.stderr


def test_fault_injection_is_documented():
    assert "## Failure behaviour" in (Path(ROOT) / "README.md").read_text()
    text = (Path(ROOT) / "docs" / "failure-behaviour.md").read_text()
    assert "## Fault injection" in text
    for kind in ("loss_error", "device_error", "backward_error", "nan_grad", "kill", "rollout_dead"):
        assert kind in text
