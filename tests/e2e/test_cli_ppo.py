"""`python -m rltrain algo=ppo` end to end: every PPO metric in every row, the critic checkpointed
and resumed with the policy, time sharing covering the critic without changing a number, rollout
correction on, and Megatron with tensor parallelism on 2 ranks."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from cli import QUICK, comparable, copy_run, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

SMALL = [
    "algo=ppo",
    "rollout=hf",
    "algo.prompts_per_step=4",
    "algo.group_size=2",
    "data.num_eval=4",
    *QUICK,
]
PPO_METRICS = (
    "critic/value_loss", "critic/explained_variance", "critic/vf_clipfrac", "critic/values_mean", "critic/grad_norm",
    "policy/clipfrac", "policy/approx_kl", "adv/mean", "adv/std", "reward/mean", "rollout/is_weight_mean",
    "rollout/masked_frac", "rollout/logprob_diff_max", "rollout/mismatch_kl", "rollout/is_ratio_max",
)
# The shared PPO run (4 steps, checkpoints at 2 and 4): every metric, the uninterrupted run the
# resume is compared with, and the run time sharing is compared with.
PPO_RUN = [*SMALL, "trainer.max_steps=4", "trainer.save_every=2", "algo.rollout_correction=tis"]


def test_ppo_logs_every_metric_and_resumes_with_its_critic(shared_runs, tmp_path):
    whole = shared_runs.get(*PPO_RUN)
    full = train_rows(whole)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    for row in full:
        for key in PPO_METRICS:
            assert key in row and math.isfinite(row[key]), (key, row)
        assert row["rollout/masked_frac"] == 0.0 and 0.5 < row["rollout/is_weight_mean"] <= 2.0
        # fp32 engine and trainer agree to round-off: the mismatch is tiny, the ratios near 1
        assert 0.0 <= row["rollout/mismatch_kl"] < 1e-4 and abs(row["rollout/is_ratio_max"] - 1.0) < 1e-2, row
    assert full[-1]["critic/value_loss"] > 0.0
    ckpt = whole / "checkpoints"
    assert any(p.name.startswith("step_") for p in ckpt.iterdir())
    assert any("critic" in str(p) for p in ckpt.rglob("*")), "the critic is checkpointed with the policy"

    # Stopped after step 2 (its checkpoint) and resumed: steps 3-4 equal the uninterrupted run's,
    # which needs the critic's weights and optimizer state back, not a fresh value head. The
    # stopped run is a private copy of the shared one as it stood after step 2: no later
    # checkpoint, no later metric row.
    run_dir = copy_run(whole, tmp_path / "resumed")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    metrics = run_dir / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= 2]
    metrics.write_text("".join(line + "\n" for line in kept))
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2]
    proc = rltrain(*PPO_RUN, run_dir=run_dir, timeout=400)
    assert "step_00000002 (step 2)" in proc.stdout  # "resumed from ... (step 2)", not trained afresh
    resumed = train_rows(run_dir)
    assert comparable(resumed) == comparable(full)


def test_time_sharing_covers_the_critic_and_changes_no_number(shared_runs, tmp_path):
    rltrain(*PPO_RUN, "placement.time_sharing=true", run_dir=tmp_path / "shared", timeout=400)
    plain, shared = train_rows(shared_runs.get(*PPO_RUN)), train_rows(tmp_path / "shared")
    assert len(shared) == len(plain) == 4
    keys = ("loss", "reward/mean", "critic/value_loss", "critic/values_mean", "adv/std")
    assert [[r[k] for k in keys] for r in shared] == [[r[k] for k in keys] for r in plain]
    assert all(r["time/phase/offload"] >= 0.0 for r in shared)


def test_ppo_on_megatron_with_tensor_parallelism(tiny_cache, tmp_path):
    rltrain(*SMALL, "backend=megatron", "backend.tp=2", "trainer.nproc=2", "trainer.max_steps=2", run_dir=tmp_path, timeout=500)
    rows = train_rows(tmp_path)
    assert len(rows) == 2
    for row in rows:
        for key in PPO_METRICS:
            assert key in row and math.isfinite(row[key]), (key, row)


def test_critic_warmup_and_the_kl_in_the_reward(tiny_cache, tmp_path):
    """The first `critic_warmup_steps` train the critic only; with `kl_in_reward` the old and the
    reference log-probabilities are scored before the advantages (no fused training pass)."""
    rltrain(*SMALL, "trainer.max_steps=2", "algo.critic_warmup_steps=1", "algo.beta=0.05", "algo.kl_in_reward=true",
            run_dir=tmp_path, timeout=400)
    rows = [r for r in read_metrics(tmp_path) if "critic/value_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "policy/clipfrac" not in rows[0]  # step 1: the critic alone
    assert "policy/clipfrac" in rows[1]
    # Step 2 scores the policy against its reference: equal, since step 1 left the policy alone.
    assert rows[1]["policy/kl"] == 0.0 and rows[1]["critic/value_loss"] > 0.0


def test_ppo_on_a_model_data_and_reward_of_the_users(tiny_cache, tmp_path):
    """A model directory of another architecture (Llama, untied, no attention biases) given by
    `model.path`, a user's prompts and a user's reward function, with the default vLLM engine."""
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    model_dir = build_tiny_model_dir(
        ModelConfig(arch="llama", attention_bias=False, tie_word_embeddings=False, hidden_size=64, num_layers=2,
                    num_heads=2, num_kv_heads=1, intermediate_size=160), seed=7)
    (tmp_path / "myppo.py").write_text(
        "def exact(prompts, completions, target, **kw):\n"
        "    return [1.0 if c.strip() == t else 0.0 for c, t in zip(completions, target)]\n"
    )
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "target": str(2 * a)}) + "\n" for a in range(40)))
    rltrain("algo=ppo", f"model.path={model_dir}", f"data.path={data}", "reward.fns=[myppo:exact]",
            "algo.prompts_per_step=4", "algo.group_size=2", "trainer.max_steps=2", *QUICK,
            run_dir=tmp_path / "run", env={"PYTHONPATH": str(tmp_path)}, timeout=400)
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 2 and all("reward/exact" in r and math.isfinite(r["critic/value_loss"]) for r in rows)
