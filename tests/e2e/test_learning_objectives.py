"""The named objectives learn on the built-in task, from the default SFT start (`slow`, `make
test-all`; docs/algorithms.md, "What the objectives learn", records one measured run of each):

- GSPO, CISPO and Dr. GRPO each raise held-out exact-match accuracy by >= 0.2 over the start;
- dynamic sampling reaches the default GRPO run's final accuracy in no more steps;
- distilling the default GRPO run's `final/` into the SFT start (`algo=distill`) recovers >= 80%
  of GRPO's gain.

Each run is its default command (300 steps, evaluated every 50 on the same 1000 held-out problems)
with only the run directory, W&B and checkpoints changed.
"""

from __future__ import annotations

import pytest
from cli import read_metrics, rltrain

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SAME_TRAINING = ["logger.wandb.mode=disabled", "trainer.save_every=0", "trainer.progress=lines"]
OBJECTIVES = {
    "gspo": ["algo.importance_level=sequence", "algo.loss_agg=seq_mean_token_mean", "algo.mini_batches=2"],
    "cispo": ["algo.policy_loss=cispo", "algo.mini_batches=2"],
    "dr_grpo": ["+experiment=dr_grpo"],
}


def accuracy_by_step(run_dir) -> dict[int, float]:
    return {r["step"]: r["eval/accuracy"] for r in read_metrics(run_dir) if "eval/accuracy" in r}


@pytest.fixture(scope="module")
def grpo_run(tiny_cache, tmp_path_factory):
    """The default GRPO command, once for the tests that compare with it."""
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    rltrain(*SAME_TRAINING, run_dir=run_dir, timeout=1800)
    return run_dir


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_named_objective_raises_heldout_accuracy_from_the_sft_start(tiny_cache, tmp_path, name):
    run_dir = tmp_path / "run"
    rltrain(*OBJECTIVES[name], *SAME_TRAINING, run_dir=run_dir, timeout=1800)
    acc = accuracy_by_step(run_dir)
    assert max(acc) == 300
    assert acc[300] - acc[0] >= 0.2, acc


def test_dynamic_sampling_reaches_grpos_final_accuracy_in_no_more_steps(grpo_run, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo.dynamic_sampling=true", *SAME_TRAINING, run_dir=run_dir, timeout=1800)
    grpo, dynamic = accuracy_by_step(grpo_run), accuracy_by_step(run_dir)
    target = grpo[300]
    reached = min((step for step, a in dynamic.items() if a >= target), default=None)
    assert reached is not None and reached <= 300, (grpo, dynamic)


def test_distilling_grpos_result_recovers_most_of_its_gain(grpo_run, tmp_path):
    run_dir = tmp_path / "run"
    rltrain("algo=distill", f"teacher.path={grpo_run / 'final'}", *SAME_TRAINING, run_dir=run_dir, timeout=1800)
    grpo, distilled = accuracy_by_step(grpo_run), accuracy_by_step(run_dir)
    assert distilled[0] == pytest.approx(grpo[0])  # the same start, measured on the same problems
    gain = grpo[300] - grpo[0]
    assert gain > 0.1, grpo
    assert distilled[300] - distilled[0] >= 0.8 * gain, (grpo, distilled)
