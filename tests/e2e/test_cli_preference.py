"""SimPO and ORPO from the command line, on FSDP, on Megatron and with LoRA: a few steps each, no reference
built, the shared `dpo/*` and `eval/dpo_accuracy` keys logged (the losses themselves:
tests/unit/algos/test_preference_reference.py; learning: tests/e2e/test_convergence.py)."""

from __future__ import annotations

import json
import math

import pytest
from cli import QUICK, read_metrics, rltrain, train_rows
from safetensors.torch import load_file

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


# SimPO on megatron is `slow`: the reference-free path on megatron is ORPO's; SimPO's loss runs in
# test_reference_free_objectives_train_and_evaluate above.
@pytest.mark.parametrize("algo", [pytest.param("simpo", marks=pytest.mark.slow), "orpo"])
def test_reference_free_objectives_on_megatron_data_parallel(tiny_cache, tmp_path, algo):
    run_dir = tmp_path / "run"
    rltrain(f"algo={algo}", "backend=megatron", "trainer.nproc=2", *SHORT, *QUICK, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[0]["pairs"] == 8.0 and rows[2]["loss"] != rows[0]["loss"]


# SimPO with LoRA is `slow`: the adapters train through the same reference-free path as ORPO's.
@pytest.mark.parametrize("algo", [pytest.param("simpo", marks=pytest.mark.slow), "orpo"])
def test_reference_free_objectives_train_lora_adapters(tiny_cache, tmp_path, algo):
    """With no reference, LoRA needs no base scoring: the adapters alone train (from zero, so the
    step-1 scores are the base model's), and final/ is a PEFT adapter directory."""
    run_dir = tmp_path / "run"
    rltrain(f"algo={algo}", "model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-2", "optim.warmup_steps=0",
            *SHORT, *QUICK, run_dir=run_dir)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    config = json.loads((run_dir / "final" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert not (run_dir / "final" / "config.json").exists()
    adapters = load_file(str(run_dir / "final" / "adapter_model.safetensors"))
    lora_b = [t for name, t in adapters.items() if "lora_B" in name]
    assert lora_b and any(t.abs().max() > 0 for t in lora_b)  # B starts at zero: the adapters trained
