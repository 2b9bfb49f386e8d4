"""`algo=kto` from the command line: on the built-in task's pairs unpaired (FSDP, and Megatron on
2 data-parallel ranks), on TRL's unpaired format in its standard and conversational forms, and
with LoRA adapters on 2 ranks (the reference is the base with the adapters off). Each run's first
loss is exactly half the weight of each example (policy = reference, z0 = 0). The loss itself:
tests/unit/algos/test_kto_loss.py and test_kto_reference.py; learning: tests/e2e/test_convergence.py."""

from __future__ import annotations

import json
import math

import pytest
from cli import QUICK, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

SHORT = ["trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "data.num_eval=8"]
KTO_KEYS = {"loss", "kto/kl", "kto/rewards_chosen", "kto/rewards_rejected", "kto/logps_chosen", "kto/logps_rejected"}


def test_kto_on_the_builtin_task_trains_and_evaluates(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=kto", *SHORT, *QUICK, "trainer.eval_every=3", "algo.undesirable_weight=1.5", run_dir=run_dir)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(KTO_KEYS <= set(r) and math.isfinite(r["loss"]) for r in rows)
    # step 1: policy = reference, so z0 = 0 and each example loses w / 2 (the batch's weighted mean)
    assert rows[0]["kto/kl"] == 0.0
    assert 0.5 <= rows[0]["loss"] <= 0.75 and rows[0]["kto/rewards_chosen"] == 0.0
    assert any(r["kto/kl"] > 0 for r in rows[1:]) or rows[2]["loss"] != rows[0]["loss"]
    evals = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and "eval/accuracy" in evals[-1]


def chat(role: str, text: str) -> list[dict]:
    return [{"role": role, "content": text}]


def unpaired_rows(numbers, form: str) -> list[dict]:
    rows = []
    for a in numbers:
        for completion, label in ((str(a + 1), True), (str(a + 3), False)):
            prompt = f"{a}+1="
            if form == "conversational":
                rows.append({"prompt": chat("user", prompt), "completion": chat("assistant", completion), "label": label})
            else:
                rows.append({"prompt": prompt, "completion": completion, "label": label})
    return rows


@pytest.mark.parametrize("form", ["standard", "conversational"])
def test_kto_reads_trls_unpaired_format(tiny_cache, tmp_path, form):
    rows = unpaired_rows(range(24), form) + [{"prompt": "9+9=", "completion": "", "label": True}]  # empty: skipped
    path, eval_path = tmp_path / "unpaired.jsonl", tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(range(50, 56), form)))
    run_dir = tmp_path / "run"
    rltrain("algo=kto", f"data.path={path}", f"data.eval_path={eval_path}", *SHORT[:3], *QUICK, "trainer.eval_every=2",
            run_dir=run_dir)
    metrics = train_rows(run_dir)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert metrics[0]["loss"] == pytest.approx(0.5, abs=1e-6) and metrics[0]["data/skipped_empty"] == 1
    evals = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r]  # held-out rows paired per prompt
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert all(min(abs(r["eval/dpo_accuracy"] * 6 - k) for k in range(7)) < 1e-5 for r in evals)  # 6 held-out pairs


@pytest.mark.slow  # preference pairs on megatron's data parallel: test_megatron_cli.py's DPO, in make test; KTO's loss is the backends' alike
def test_kto_on_megatron_data_parallel(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=kto", "backend=megatron", "trainer.nproc=2", *SHORT, *QUICK, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-6) and rows[0]["kto/kl"] == 0.0
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[0]["examples"] == 8.0 and rows[2]["loss"] != rows[0]["loss"]


# slow: a LoRA reference scored with the adapters off is test_cli_lora.py's DPO, KTO on several ranks
# test_kto_on_megatron_data_parallel, both in make test.
@pytest.mark.slow
def test_lora_kto_on_two_ranks_scores_its_reference_with_the_adapters_off(tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=kto", "model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-2", "optim.warmup_steps=0",
            "trainer.nproc=2", *SHORT, *QUICK, run_dir=run_dir, timeout=400)
    rows = train_rows(run_dir)
    # adapters start at zero: the policy is its reference at step 1
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-6) and rows[0]["kto/kl"] == 0.0
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (run_dir / "final" / "adapter_config.json").is_file()


def test_a_batch_of_one_example_is_refused(tiny_cache, tmp_path):
    proc = rltrain("algo=kto", "trainer.global_batch_size=1", "trainer.micro_batch_size=1", *QUICK,
                   run_dir=tmp_path / "run", check=False)
    assert proc.returncode == 2 and "at least 2" in proc.stderr and "Traceback" not in proc.stderr
