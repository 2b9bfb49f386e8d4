"""Failure behaviour of real 2-rank `backend=megatron` runs, driven by `debug.fault` (issue 6).

The exact weight comparisons live in tests/dist/safety/test_safety_megatron.py; these runs prove the
wiring from the command line: recover mode completes under pp=2 and tp=2 with the errors counted
once, a NaN gradient skips the step without advancing the LR, and fail-fast stops every rank.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli import QUICK, rltrain, train_rows

pytestmark = pytest.mark.e2e

TIMEOUT_S = 30  # safety.collective_timeout_s of these runs
SMALL = [
    "algo=sft",
    "backend=megatron",
    "trainer.nproc=2",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "data.num_eval=4",
    f"safety.collective_timeout_s={TIMEOUT_S}",
    *QUICK,
]


def _final_weights_finite(run_dir: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    files = sorted((run_dir / "final").glob("*.safetensors"))
    return bool(files) and all(torch.isfinite(t).all() for f in files for t in load_file(f).values())


def test_pp2_loss_error_on_the_last_stage_recovers(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = rltrain(*SMALL, "backend.pp=2", "trainer.max_steps=3", "debug.fault=loss_error:1:2", run_dir=run_dir,
                   timeout=180)
    rows = train_rows(run_dir)
    assert [r["safety/recovered_errors"] for r in rows] == [0.0, 1.0, 0.0]
    assert all(r["safety/skipped_steps"] == 0.0 for r in rows)
    assert "rltrain: rank 1: recovered from an error in the loss of micro-batch 0 of step 2" in proc.stderr
    assert proc.stderr.count("InjectedFault: loss_error") == 1
    assert _final_weights_finite(run_dir)


def test_tp2_loss_error_is_agreed_and_nan_grad_skips_without_advancing_the_lr(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = rltrain(*SMALL, "backend.tp=2", "trainer.max_steps=4", "debug.fault='loss_error:1:2,nan_grad:0:3'",
                   run_dir=run_dir, timeout=180)
    rows = train_rows(run_dir)
    assert [r["safety/recovered_errors"] for r in rows] == [0.0, 1.0, 0.0, 0.0]  # counted once, not per TP rank
    assert [r["safety/skipped_steps"] for r in rows] == [0.0, 0.0, 1.0, 0.0]
    assert rows[3]["lr"] == rows[2]["lr"] > rows[1]["lr"]  # warm-up: the skipped step did not advance it
    assert "rank 0: the loss of micro-batch 0 of step 2 is replaced by a zero" in proc.stderr
    assert _final_weights_finite(run_dir)


# slow: fail-fast's bounded exit is test_safety_cli.py's, the tp ranks' agreement on a loss error
# test_tp2_loss_error_is_agreed_and_nan_grad_skips_without_advancing_the_lr, both in make test.
@pytest.mark.slow
def test_fail_fast_loss_error_exits_non_zero_in_bounded_time(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = rltrain(*SMALL, "backend.pp=2", "trainer.max_steps=4", "debug.fault=loss_error:1:2", run_dir=run_dir,
                   env={"RLTRAIN_FAIL_FAST": "1"}, check=False, timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120
    assert "InjectedFault: loss_error injected by debug.fault on rank 1 at step 2" in proc.stderr
    assert "raised on rank 1" in proc.stderr and "rank 1 exited with code 1" in proc.stderr
    assert not (run_dir / "final").exists() and len(train_rows(run_dir)) == 1
