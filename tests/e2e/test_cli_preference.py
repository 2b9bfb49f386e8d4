"""SimPO and ORPO from the command line, on FSDP and on Megatron: a few steps each, no reference
built, the shared `dpo/*` and `eval/dpo_accuracy` keys logged (the losses themselves:
tests/unit/algos/test_preference_reference.py; learning: tests/e2e/test_convergence.py)."""

from __future__ import annotations

import math

import pytest
from cli import QUICK, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

SHORT = ["trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "data.num_eval=8"]
PAIR_KEYS = {"loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "dpo/accuracy", "dpo/logps_chosen"}


@pytest.mark.parametrize("algo", ["simpo", "orpo"])
def test_reference_free_objectives_train_and_evaluate(tiny_cache, tmp_path, algo):
    run_dir = tmp_path / "run"
    rltrain(f"algo={algo}", *SHORT, *QUICK, "trainer.eval_every=3", run_dir=run_dir)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(PAIR_KEYS <= set(r) and math.isfinite(r["loss"]) for r in rows)
    if algo == "simpo":  # the first step's policy gives both completions similar scores: loss near -log s(-gamma)
        assert rows[0]["loss"] == pytest.approx(-math.log(1 / (1 + math.e)), abs=0.2)
    else:
        assert rows[0]["loss"] == pytest.approx(rows[0]["orpo/nll"] + 0.1 * rows[0]["orpo/odds_ratio_loss"], rel=1e-5)
    evals = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert not (run_dir / "ref_logps.safetensors").exists()


@pytest.mark.parametrize("algo", ["simpo", "orpo"])
def test_reference_free_objectives_on_megatron_data_parallel(tiny_cache, tmp_path, algo):
    run_dir = tmp_path / "run"
    rltrain(f"algo={algo}", "backend=megatron", "trainer.nproc=2", *SHORT, *QUICK, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[0]["pairs"] == 8.0 and rows[2]["loss"] != rows[0]["loss"]
