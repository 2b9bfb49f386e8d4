"""`trainer.max_tokens_per_micro_batch` changes how a step is cut into micro-batches, never its
numbers: each algorithm's loss and gradient norm equal the row-count split's, also on 2 ranks
(where the ranks must agree on how many micro-batches to run)."""

from __future__ import annotations

import pytest
from cli import DPO_RUN, GRPO_HF_RUN, SFT_RUN_2_RANKS, rltrain, train_rows

from rltrain.data.sharding import split_micro_batches

pytestmark = pytest.mark.e2e

# The row-count split is the shared run (tests/cli.py); SFT's is on 2 ranks.
CASES = {"sft": SFT_RUN_2_RANKS, "dpo": DPO_RUN, "grpo": GRPO_HF_RUN}
STEPS = {"sft": 6, "dpo": 6, "grpo": 4}


# DPO is `slow`: its pairs share their prompt as GRPO's groups do, whose budgeted run stays.
@pytest.mark.parametrize("algo", [pytest.param(a, marks=pytest.mark.slow) if a == "dpo" else a for a in sorted(CASES)])
def test_a_token_budget_does_not_change_the_numbers(algo, shared_runs, tmp_path):
    rows = train_rows(shared_runs.get(*CASES[algo]))
    rltrain(*CASES[algo], "trainer.max_tokens_per_micro_batch=40", "trainer.save_every=0", "logger.wandb.mode=disabled",
            run_dir=tmp_path / "budget")
    budget = train_rows(tmp_path / "budget")
    assert len(rows) == len(budget) == STEPS[algo]
    for a, b in zip(rows, budget):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_token_budget_split_fills_in_order_up_to_rows_and_tokens():
    items, sizes = list("abcdef"), [10, 25, 10, 50, 5, 5]
    assert split_micro_batches(items, 1, 3, sizes, max_tokens=40) == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert split_micro_batches(items, 1, 2, sizes, max_tokens=1000) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert split_micro_batches(items, 4, 2) == [["a", "b"], ["c", "d"], ["e", "f"], []]
    assert split_micro_batches([], 1, 2, [], max_tokens=10) == [[]]
