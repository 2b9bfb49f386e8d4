"""`algo=rm` from the command line: a few Bradley-Terry steps log `rm/*` and `eval/rm_accuracy`,
`final/` is a one-output sequence classifier with the policy's tokenizer, and a GRPO run loads it
as is with `reward_model=hf reward_model.path=<final>` and logs `reward/model` (the loss:
tests/unit/algos/test_reward_model_loss.py; the export's scores:
tests/dist/backends/test_reward_model_export.py; learning: tests/e2e/test_convergence.py)."""

from __future__ import annotations

import json
import math

import pytest
from cli import QUICK, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

RM_KEYS = {"loss", "rm/accuracy", "rm/margin", "rm/rewards_chosen", "rm/rewards_rejected", "grad_norm"}


def test_a_trained_reward_model_scores_a_grpo_run(tiny_cache, tmp_path):
    rm_dir = tmp_path / "rm"
    rltrain("algo=rm", "trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
            "data.num_eval=16", *QUICK, "trainer.eval_every=3", run_dir=rm_dir)
    rows = train_rows(rm_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(RM_KEYS <= set(r) and math.isfinite(r["loss"]) for r in rows)
    assert all(0.0 <= r["rm/accuracy"] <= 1.0 for r in rows)
    evals = [r for r in read_metrics(rm_dir) if "eval/rm_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    final = rm_dir / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and len(config["id2label"]) == 1
    assert (final / "tokenizer_config.json").is_file()

    grpo_dir = tmp_path / "grpo"
    rltrain("algo=grpo", "rollout=hf", "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=2",
            "data.num_eval=8", *QUICK, "reward_model=hf", f"reward_model.path={final}", run_dir=grpo_dir, timeout=400)
    grpo_rows = train_rows(grpo_dir)
    assert len(grpo_rows) == 2
    assert all(math.isfinite(r["reward/model"]) and r["reward/model"] != 0.0 for r in grpo_rows)


def test_a_reward_model_on_megatron_is_refused(tiny_cache, tmp_path):
    proc = rltrain("algo=rm", "backend=megatron", *QUICK, run_dir=tmp_path / "run", check=False)
    assert proc.returncode == 2
    assert "algo=rm with backend=megatron" in proc.stderr and "Set backend=fsdp" in proc.stderr
