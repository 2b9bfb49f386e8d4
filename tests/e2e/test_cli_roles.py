"""Roles from the command line, with models of ours: a reward model adds `reward/model` to GRPO's
rewards by weight; `reference.path` really changes DPO's reference; a reference with another
tokenizer stops the run with one paragraph naming both directories."""

from __future__ import annotations

import math

import pytest
from cli import QUICK, rltrain, train_rows

from rltrain.config.schema import ModelConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.models.tiny_reward import build_tiny_reward_model_dir
from rltrain.models.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.e2e

SMALL = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
DPO = ["algo=dpo", "trainer.max_steps=1", "trainer.global_batch_size=8", "trainer.micro_batch_size=8", *QUICK]


def test_grpo_adds_the_reward_model_by_weight(tiny_cache, tmp_path):
    """The reward model is one more weighted reward; with time sharing it leaves the device for
    the engine's turn (a no-op on CPU, the wiring is real) and no number changes."""
    reward_dir = build_tiny_reward_model_dir(tmp_path / "reward", seed=5, cfg=ModelConfig(**SMALL))
    runs = {}
    for sharing in ("false", "true"):
        run_dir = tmp_path / f"run-{sharing}"
        rltrain("algo=grpo", "rollout=hf", "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=2", "data.num_eval=8", *QUICK,
                "reward_model=hf", f"reward_model.path={reward_dir}", "reward_model.weight=0.5",
                f"placement.time_sharing={sharing}", run_dir=run_dir, timeout=400)
        runs[sharing] = rows = train_rows(run_dir)
        assert len(rows) == 2
        for row in rows:
            assert row["reward/model"] != 0.0
            total = row["reward/addition_reward"] + 0.5 * row["reward/model"]
            assert row["reward/mean"] == pytest.approx(total, rel=1e-5, abs=1e-6)
    assert "time/phase/offload" in runs["true"][0] and "time/phase/offload" not in runs["false"][0]
    for on, off in zip(runs["true"], runs["false"], strict=True):
        for key in ("reward/model", "reward/mean", "loss"):
            assert on[key] == off[key], key


def test_dpo_with_a_reference_path_scores_against_that_model(tiny_cache, tmp_path):
    other = build_tiny_model_dir(ModelConfig(cache_dir=str(tmp_path / "models"), **SMALL), seed=9)
    rltrain(*DPO, run_dir=tmp_path / "default")
    rltrain(*DPO, f"reference.path={other}", run_dir=tmp_path / "other")
    default, changed = train_rows(tmp_path / "default")[0], train_rows(tmp_path / "other")[0]
    # At the first step the default reference is the policy itself: every margin is 0, loss log 2.
    assert default["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(changed["loss"] - default["loss"]) > 1e-3
    assert abs(changed["dpo/margin"]) > 1e-3


def test_a_reference_with_another_tokenizer_stops_the_run(tiny_cache, tmp_path):
    other = build_tiny_model_dir(ModelConfig(cache_dir=str(tmp_path / "models"), **SMALL), seed=9)
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(str(other))
    proc = rltrain(*DPO, f"reference.path={other}", run_dir=tmp_path / "run", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"reference.path='{other}' has a different tokenizer from the policy's" in proc.stderr
    assert "the vocabularies have 100 and 101 tokens" in proc.stderr
