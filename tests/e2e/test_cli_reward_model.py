"""`algo=rm` from the command line: a few Bradley-Terry steps log `rm/*` and `eval/rm_accuracy`,
`final/` is a one-output sequence classifier with the policy's tokenizer, and a GRPO run loads it
as is with `reward_model=hf reward_model.path=<final>` and logs `reward/model`. On Megatron (tp=2,
2 ranks) the rows and held-out accuracies are FSDP's (1e-5 relative) and `final/` is FSDP's
classifier up to what 3 AdamW steps can move; with LoRA (2 FSDP ranks) the first step is full
fine-tuning's (the adapters start at zero) and `final/` is a plain merged classifier. The loss:
tests/unit/algos/test_reward_model_loss.py; the export's scores, every layout:
tests/dist/backends/test_reward_model_export.py; learning: tests/e2e/test_convergence.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli import QUICK, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

RM_KEYS = {"loss", "rm/accuracy", "rm/margin", "rm/rewards_chosen", "rm/rewards_rejected", "grad_norm"}


RM_RUN = ["algo=rm", "trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
          "data.num_eval=16", *QUICK, "trainer.eval_every=3"]
COMPARED = ("loss", "grad_norm", "rm/margin", "rm/accuracy", "rm/rewards_chosen")
TEXTS = (["12+34=", "7+5="], ["46", "13"])  # (prompts, completions) the classifiers score


@pytest.fixture
def fsdp_rm(shared_runs) -> Path:
    return shared_runs.get(*RM_RUN)


def _evals(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/rm_accuracy"]) for r in read_metrics(run_dir) if "eval/rm_accuracy" in r]


def _reward_model(final: Path):
    """`final/` loaded as `reward_model=hf reward_model.path=<final>` loads it."""
    import torch

    from rltrain.rewards.model_reward import SequenceClassifierReward

    return SequenceClassifierReward(final, torch.device("cpu"), torch.float32, batch_size=2, max_length=64)


def _assert_is_a_classifier(final: Path) -> None:
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and len(config["id2label"]) == 1
    assert (final / "tokenizer_config.json").is_file() and not (final / "adapter_config.json").exists()


def test_a_trained_reward_model_scores_a_grpo_run(fsdp_rm, tmp_path):
    rows = train_rows(fsdp_rm)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(RM_KEYS <= set(r) and math.isfinite(r["loss"]) for r in rows)
    assert all(0.0 <= r["rm/accuracy"] <= 1.0 for r in rows)
    assert [step for step, _ in _evals(fsdp_rm)] == [0, 3]
    final = fsdp_rm / "final"
    _assert_is_a_classifier(final)

    grpo_dir = tmp_path / "grpo"
    rltrain("algo=grpo", "rollout=hf", "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=2",
            "data.num_eval=8", *QUICK, "reward_model=hf", f"reward_model.path={final}", run_dir=grpo_dir, timeout=400)
    grpo_rows = train_rows(grpo_dir)
    assert len(grpo_rows) == 2
    assert all(math.isfinite(r["reward/model"]) and r["reward/model"] != 0.0 for r in grpo_rows)


def test_a_reward_model_on_megatron_tp2_equals_fsdps(fsdp_rm, tmp_path):
    import torch
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    rltrain(*RM_RUN, "backend=megatron", "backend.tp=2", "trainer.nproc=2", run_dir=run_dir, timeout=400)
    rows, reference = train_rows(run_dir), train_rows(fsdp_rm)
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3]
    for row, ref in zip(rows, reference, strict=True):
        for key in COMPARED:
            assert row[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (row["step"], key)
    assert _evals(run_dir) == _evals(fsdp_rm)

    final = run_dir / "final"
    _assert_is_a_classifier(final)
    ours, theirs = load_file(final / "model.safetensors"), load_file(fsdp_rm / "final" / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and "score.weight" in ours
    # AdamW moves a weight by at most ~lr per step whatever its gradient: two backends whose
    # gradients differ by round-off differ by at most twice the 3 warm-up lrs' sum (6e-4).
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape and tensor.dtype == theirs[name].dtype, name
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1.2e-3, msg=name)
    scores, fsdp_scores = _reward_model(final)(*TEXTS), _reward_model(fsdp_rm / "final")(*TEXTS)
    # Through reward_model=hf's loader the two classifiers score alike (about 1e-5 apart here).
    assert scores == pytest.approx(fsdp_scores, abs=1e-3) and scores[0] != scores[1]


def test_a_lora_reward_model_starts_as_full_fine_tuning_and_exports_a_merged_classifier(fsdp_rm, tmp_path):
    run_dir = tmp_path / "run"
    rltrain(*RM_RUN, "model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-2", "trainer.nproc=2",
            run_dir=run_dir, timeout=400)
    rows, reference = train_rows(run_dir), train_rows(fsdp_rm)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The adapters start at zero and the head from trainer.seed: step 1 scores the full model's pairs.
    for key in ("loss", "rm/margin", "rm/accuracy"):
        assert rows[0][key] == pytest.approx(reference[0][key], rel=1e-5, abs=1e-7), key
    assert _evals(run_dir)[0] == _evals(fsdp_rm)[0] and [step for step, _ in _evals(run_dir)] == [0, 3]
    final = run_dir / "final"
    _assert_is_a_classifier(final)
    assert not (final / "merged").exists()
    # Merged: the adapted projections moved off the base, the frozen weights did not.
    from safetensors.torch import load_file

    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    ours, base = load_file(final / "model.safetensors"), load_file(build_tiny_model_dir(ModelConfig(), 0) / "model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert (ours[q_proj] - base[q_proj]).abs().max() > 1e-5
    assert all(ours[name].equal(base[name]) for name in ("model.embed_tokens.weight", "model.norm.weight"))
    scores = _reward_model(final)(*TEXTS)
    assert all(math.isfinite(s) for s in scores) and scores[0] != scores[1]
