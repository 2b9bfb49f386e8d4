"""On-policy distillation (`algo=distill`) end to end: the student samples with the run's rollout
engine, the teacher (`teacher.path`, its own frozen engine on the policy's backend) scores the same
tokens, and the per-token reverse KL is the objective (`distill/reverse_kl`).

- A teacher that is the student's own start: the reverse KL and the k3 KL are 0 at step 1.
- A teacher given a short SFT (the shared SFT run's `final/`, a larger model than the student), on
  FSDP with vLLM, on Megatron, and with a LoRA student: the run trains, logs the objective, and the
  student ends nearer the teacher than it started.
The learning claim (distilling GRPO's result recovers most of its gain) is a `slow` test in
tests/e2e/test_learning_objectives.py.
"""

from __future__ import annotations

import json
import math

import pytest
from cli import QUICK, SFT_RUN, SMALL_MODEL, rltrain, train_rows

pytestmark = pytest.mark.e2e

ARGS = [
    "algo=distill", *QUICK, *SMALL_MODEL, "algo.prompts_per_step=8", "algo.group_size=2", "data.num_eval=8",
    "trainer.log_every=1", "optim.warmup_steps=0",
]


def tiny_dir(seed: int):
    """The small tiny model built with `seed` (seed 0 is the student's start)."""
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    small = {k.split(".")[1]: int(v) for k, v in (a.split("=") for a in SMALL_MODEL)}
    return build_tiny_model_dir(ModelConfig(**small), seed=seed)


def test_a_teacher_that_is_the_students_start_is_at_zero_reverse_kl(tmp_path):
    run_dir = tmp_path / "run"
    rltrain(*ARGS, f"teacher.path={tiny_dir(0)}", "trainer.max_steps=1", run_dir=run_dir)
    (row,) = train_rows(run_dir)
    assert row["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert row["policy/kl"] == pytest.approx(0.0, abs=1e-6)
    assert "reward/mean" in row  # the task's reward is still measured, as a metric only


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(["rollout=vllm", "optim.lr=3e-3"], id="fsdp-vllm"),
        pytest.param(["backend=megatron", "rollout=hf", "optim.lr=3e-3"], id="megatron-hf"),
        pytest.param(["model.lora.rank=8", "model.lora.alpha=16", "rollout=hf", "optim.lr=1e-2"], id="fsdp-lora-hf"),
    ],
)
def test_the_student_moves_towards_its_teacher(shared_runs, tmp_path, variant):
    teacher = shared_runs.get(*SFT_RUN) / "final"
    run_dir = tmp_path / "run"
    rltrain(
        *ARGS, *variant, f"teacher.path={teacher}", "trainer.max_steps=8", "optim.schedule=constant",
        run_dir=run_dir, timeout=400,
    )
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(math.isfinite(r["distill/reverse_kl"]) and r["policy/kl"] >= 0 for r in rows)
    # The k3 estimate of KL(student || teacher) on the student's samples, averaged over the first and
    # the last steps: lower at the end.
    first, last = (sum(r["policy/kl"] for r in part) / len(part) for part in (rows[:3], rows[-3:]))
    assert last < first, [r["policy/kl"] for r in rows]
    if "model.lora.rank=8" in variant:
        assert json.loads((run_dir / "final" / "adapter_config.json").read_text())["r"] == 8
