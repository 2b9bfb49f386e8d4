"""`model.lora.rank > 0` end to end (docs/lora.md): GRPO on 2 ranks samples from the adapters
(vLLM's log-probabilities equal the trainer's every step, the KL to the base grows) and writes a
PEFT adapter directory plus the merged model; SFT on 2 ranks checkpoints the adapters only and
resumes to the uninterrupted run's numbers; DPO's reference is the base (its first loss is
exactly log 2); PPO trains a full critic beside the adapters; and a sync broken on purpose (the
adapters left out of the weights the engine gets) stops the run at the first step that shows it.
The engine's numbers against transformers: tests/dist/backends/test_lora_engine.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from cli import QUICK, SMALL_MODEL, comparable, copy_run, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

LORA = ["model.lora.rank=8", "model.lora.alpha=16"]
# Adapters start at zero, so they need a larger step than full fine-tuning to move in a few steps.
FAST = ["optim.lr=1e-2", "optim.warmup_steps=0"]


def test_lora_grpo_on_two_ranks_samples_from_the_adapters_and_writes_a_peft_directory(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    rltrain(
        "algo=grpo", *QUICK, *SMALL_MODEL, *LORA, *FAST, "model.lora.save_merged=true", "algo.beta=0.04", "data.num_eval=8",
        "algo.prompts_per_step=4", "algo.group_size=4", "trainer.max_steps=3", "trainer.nproc=2",
        run_dir=run_dir, timeout=400,
    )
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # the engine samples from the merged adapters: fp32 parity every step
        assert row["rollout/logprob_diff_max"] < 1e-3, row
    assert rows[0]["policy/kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the policy's start
    assert rows[-1]["policy/kl"] > 1e-5  # and stays there while the adapters move

    final = run_dir / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert not (final / "config.json").exists() and (final / "tokenizer.json").exists()
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged_by_peft = PeftModel.from_pretrained(base, str(final)).merge_and_unload().state_dict()
    merged = load_file(str(final / "merged" / "model.safetensors"))
    assert (final / "merged" / "config.json").exists() and (final / "merged" / "tokenizer.json").exists()
    moved = 0
    for name, value in merged.items():
        torch.testing.assert_close(value, merged_by_peft[name], rtol=0, atol=1e-6)
        moved += not torch.equal(value, base_state[name])
    assert moved > 0  # the adapters trained


def test_lora_sft_on_two_ranks_checkpoints_the_adapters_only_and_resumes_exactly(tmp_path):
    args = [
        "algo=sft", *QUICK, *LORA, *FAST, "trainer.nproc=2", "trainer.max_steps=4", "trainer.save_every=2",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
    ]
    whole = tmp_path / "whole"
    rltrain(*args, run_dir=whole, timeout=400)
    full = train_rows(whole)
    assert [r["step"] for r in full] == [1, 2, 3, 4] and full[-1]["loss"] < full[0]["loss"]
    # A checkpoint holds the adapters and their optimizer state: less than the model's weights alone
    # (full fine-tuning checkpoints the weights and two Adam moments, three times as much).
    policy_bytes = sum(p.stat().st_size for p in (whole / "checkpoints" / "step_00000004" / "policy").rglob("*") if p.is_file())
    model_dir = Path(json.loads((whole / "final" / "adapter_config.json").read_text())["base_model_name_or_path"])
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert 0 < policy_bytes < model_bytes, (policy_bytes, model_bytes)

    resumed = copy_run(whole, tmp_path / "resumed")
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    shutil.rmtree(resumed / "final")
    metrics = resumed / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= 2]
    metrics.write_text("".join(line + "\n" for line in kept))
    proc = rltrain(*args, run_dir=resumed, timeout=400)
    assert "step_00000002 (step 2)" in proc.stdout
    assert comparable(train_rows(resumed)) == comparable(full)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (resumed / "final" / name).read_bytes() == (whole / "final" / name).read_bytes()


def test_lora_dpo_scores_its_reference_with_the_adapters_off(tmp_path):
    run_dir = tmp_path / "run"
    rltrain(
        "algo=dpo", *QUICK, *LORA, *FAST, "trainer.max_steps=3", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=8", "trainer.eval_every=3", "data.num_eval=8", run_dir=run_dir, timeout=400,
    )
    rows = train_rows(run_dir)
    # Adapters start at zero, so the policy is its reference at step 1: a margin of 0, loss log 2.
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["loss"] < rows[0]["loss"]
    evals = [r for r in read_metrics(run_dir) if "eval/dpo_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]


def test_lora_ppo_trains_a_full_critic_beside_the_adapters(tmp_path):
    run_dir = tmp_path / "run"
    rltrain(
        "algo=ppo", "rollout=hf", *QUICK, *LORA, *FAST, "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=8",
        "trainer.max_steps=2", run_dir=run_dir, timeout=400,
    )
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3
        assert math.isfinite(row["critic/value_loss"]) and row["critic/grad_norm"] > 0


def test_a_sync_that_leaves_the_adapters_out_stops_the_run_loudly(tmp_path):
    run_dir = tmp_path / "run"
    proc = rltrain(
        "algo=grpo", "rollout=hf", *QUICK, *LORA, *FAST, "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=8",
        "trainer.max_steps=4", "trainer.save_every=1", "debug.fault=adapter_dropped:0:1",
        run_dir=run_dir, timeout=400, check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "the rollout engine is not sampling from the trainer's weights: at step 2" in out
    assert "safety.max_logprob_diff=0.01" in out
    # Step 1 (before the broken sync) is logged and checkpointed; step 2 neither.
    assert [r["step"] for r in train_rows(run_dir)] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000001"]
