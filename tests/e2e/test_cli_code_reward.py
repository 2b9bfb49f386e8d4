"""The code reward in a GRPO run from the command line: a local code dataset in both layouts
(stdin/stdout cases and asserts), every completion run in the bubblewrap sandbox, the code metrics
in metrics.jsonl; and a machine without bwrap told how to install it before anything is built."""

from __future__ import annotations

import json

import pytest
from cli import QUICK, rltrain, train_rows

pytestmark = pytest.mark.e2e

CODE_METRICS = ("reward/code_pass_rate", "reward/code_timeouts", "reward/code_errors", "reward/sandbox_killed")


def code_rows() -> list[dict]:
    """Stdin/stdout rows (a program printing nothing passes the first case) and assert rows (MBPP's
    list of asserts, HumanEval's check(candidate) on an entry point)."""
    rows = []
    for a in range(12):
        rows.append({"prompt": f"{a}+{a}=", "input_output": json.dumps({"inputs": ["", ""], "outputs": ["", str(2 * a)]})})
        rows.append({"prompt": f"{a}*2=", "test": ["assert True", f"assert {a} == {a}"]})
        rows.append({"prompt": f"{a}*3=", "test": ["def check(candidate):\n    assert candidate is not None\n"], "entry_point": "print"})
    return rows


def test_grpo_with_the_code_reward_logs_its_metrics(tiny_cache, tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in code_rows()))
    run_dir = tmp_path / "run"
    rltrain(
        "algo=grpo", "algo.prompts_per_step=4", "algo.group_size=4", "algo.max_new_tokens=8", "data.eval_fraction=0",
        "rollout=hf", f"data.path={data}", "reward.fns=[rltrain.rewards.code:tests_pass]", "reward.sandbox.timeout_s=3",
        "trainer.max_steps=2", "+data.chat_template_kwargs.enable_thinking=false", *QUICK, run_dir=run_dir, timeout=400,
    )
    steps = train_rows(run_dir)
    assert len(steps) == 2
    for row in steps:
        assert set(CODE_METRICS) <= set(row), set(CODE_METRICS) - set(row)
        assert row["reward/code_pass_rate"] == pytest.approx(row["reward/tests_pass"])  # the fraction passed is the reward
        assert 0.0 <= row["reward/code_pass_rate"] <= 1.0
        counts = [row[k] for k in CODE_METRICS[1:]]
        assert all(c == int(c) and 0 <= c <= 16 for c in counts)  # samples of the step's 16, summed
        assert (row["reward/timeouts"], row["reward/errors"]) == (0.0, 0.0)  # the reward calls themselves never failed
        assert 0.0 <= row["rollout/thinking_tokens_mean"] <= 8  # of at most algo.max_new_tokens
    # The sandbox ran them: the random model's text mostly fails to parse, and each such sample is counted.
    assert sum(row["reward/code_errors"] for row in steps) > 0


def test_without_bwrap_the_run_stops_at_start_saying_how_to_install_it(tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "test": "assert True"}) + "\n")
    proc = rltrain("algo=grpo", f"data.path={data}", "reward.fns=[rltrain.rewards.code:tests_pass]", *QUICK,
                   run_dir=tmp_path / "run", env={"PATH": str(tmp_path)}, check=False, warm=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "apt-get install -y bubblewrap" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
