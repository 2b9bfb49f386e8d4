"""Mixture-of-Experts runs end to end (docs/moe.md): GRPO on the tiny MoE from its SFT start
(model=tiny_moe_sft, a short SFT here) with vLLM in process, every expert synced each step and
the engine's log-probabilities the trainer's to fp32 round-off; the other engines (a separate
vLLM process, transformers, vLLM API servers) at full length in `slow`."""

from __future__ import annotations

import pytest
from cli import read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

MOE_GRPO = [
    "algo=grpo", "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=4", "trainer.max_steps=2",
    "trainer.save_every=0", "trainer.eval_every=0", "logger.wandb.mode=disabled", "trainer.progress=lines",
]
PARITY = 1e-3  # rollout/logprob_diff_max in fp32 (docs/moe.md)


def assert_engine_samples_the_trainers_weights(run_dir, steps: int) -> None:
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["rollout/logprob_diff_max"] < PARITY, r


def test_grpo_on_the_tiny_moe_sft_start_syncs_every_expert_to_vllm(tiny_cache, tmp_path):
    from safetensors import safe_open

    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe_sft", "model.sft_steps=4", run_dir=run_dir, timeout=500)
    assert_engine_samples_the_trainers_weights(run_dir, 2)
    with safe_open(run_dir / "final" / "model.safetensors", "pt") as f:  # a checkpoint like the one loaded
        names = set(f.keys())
    assert {f"model.layers.3.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= names
    starts = list((tiny_cache / "models").glob("tiny-qwen3_moe-*-sft-*"))
    assert starts and all((s / "sft_metrics.jsonl").exists() for s in starts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine", [["rollout.process=separate"], ["rollout=hf"], ["rollout=server", "rollout.servers.spawn=1"]],
    ids=["separate", "hf", "server"],
)
def test_grpo_on_the_tiny_moe_with_each_engine(engine, tiny_cache, tmp_path):
    run_dir = tmp_path / "run"
    rltrain(*MOE_GRPO, "model=tiny_moe", "trainer.max_steps=3", *engine, run_dir=run_dir, timeout=600)
    assert_engine_samples_the_trainers_weights(run_dir, 3)
    assert read_metrics(run_dir)
