"""Errors on any rank reach the user once (issue 14, points 2 and 3): a user error raised on rank 1
ends like one on rank 0 (one paragraph naming the rank, exit 2, no traceback); a hanging reward
function is bounded by `reward.timeout_s`; a rank with no prompts calls no reward function; reward
calls that hang or raise cost their own samples (issue 23, point 3)."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli import QUICK, ROOT, rltrain, train_rows

pytestmark = pytest.mark.e2e

TWO_RANKS = ["algo=grpo", "algo.group_size=2", "trainer.max_steps=2", "trainer.nproc=2", "data.num_eval=8", *QUICK]
# Where the rollout engine plays no part in what is checked (how the launcher reports, the reward
# timeout), the transformers engine: it starts in a fraction of vLLM's time on CPU.
TWO_RANKS_HF = [*TWO_RANKS, "rollout=hf"]

REWARDS = textwrap.dedent("""
    import os
    import time

    def rank1_fails(prompts, completions, answer, **_):
        if os.environ.get("RANK") == "1":
            raise ValueError("no usable answer column on this rank")
        return [0.0] * len(completions)

    def needs_answer(prompts, completions, answer, **_):
        assert len(answer) == len(completions) > 0, "called without completions"
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    def hangs(prompts, completions, **_):
        while True:
            time.sleep(1)

    def flaky(prompts, completions, **_):
        a = int(prompts[0].split("+")[0])  # one call is one prompt's group
        if a % 4 == 0:
            time.sleep(1000)
        if a % 4 == 1:
            raise ValueError("odd one")
        return [1.0] * len(completions)
""")


@pytest.fixture
def rewards(tmp_path) -> dict:
    (tmp_path / "rw_rank.py").write_text(REWARDS)
    return {"PYTHONPATH": str(tmp_path)}


def _one_paragraph(stderr: str, needle: str) -> None:
    assert stderr.count(needle) == 1, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    assert "a collective failed" not in stderr  # the peers stopped by it stay quiet


def test_user_error_on_rank_1_is_reported_once_with_exit_2(tiny_cache, tmp_path, rewards):
    run_dir = tmp_path / "run"
    proc = rltrain(*TWO_RANKS, "algo.prompts_per_step=2", "reward.fns=[rw_rank:rank1_fails]", run_dir=run_dir,
                   env=rewards, check=False, timeout=400)
    assert proc.returncode == 2, proc.stderr[-4000:]
    _one_paragraph(proc.stderr, "rltrain: error: rank 1: reward function 'rw_rank:rank1_fails' raised ValueError: "
                                "no usable answer column on this rank")
    assert proc.stderr.count("rltrain: error") == 1


def test_user_error_on_rank_1_under_torchrun(tiny_cache, tmp_path, rewards):
    import os
    import subprocess

    torchrun = Path(sys.executable).parent / "torchrun"
    args = [a for a in TWO_RANKS_HF if a != "trainer.nproc=2"]
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rltrain", *args, "algo.prompts_per_step=2",
           "reward.fns=[rw_rank:rank1_fails]", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **rewards), capture_output=True, text=True, timeout=400)
    assert proc.returncode != 0
    # The failing rank prints its paragraph, naming itself, once; rank 0 stays quiet.
    assert proc.stderr.count("rltrain: error: rank 1: reward function 'rw_rank:rank1_fails' raised ValueError") == 1, proc.stderr[-4000:]
    assert "exitcode  : 2" in proc.stderr  # torchrun's report of rank 1


def test_hanging_reward_is_bounded_by_reward_timeout(tiny_cache, tmp_path, rewards):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = rltrain(*TWO_RANKS_HF, "algo.prompts_per_step=2", "reward.fns=[rw_rank:hangs]", "reward.timeout_s=2",
                   run_dir=run_dir, env=rewards, check=False, timeout=400)
    assert proc.returncode == 2, proc.stderr[-4000:]
    _one_paragraph(proc.stderr, "reward function 'rw_rank:hangs' did not return within reward.timeout_s=2 s")
    assert time.monotonic() - t0 < 300
    assert not (run_dir / "final").exists()


def test_failing_reward_chunks_cost_their_samples_and_the_run_goes_on(tiny_cache, tmp_path, rewards):
    """Groups whose reward call hangs or raises score reward.on_failure, are counted, and the run
    finishes (max_failure_frac=1: no share of failures stops it)."""
    run_dir = tmp_path / "run"
    rltrain(*TWO_RANKS_HF, "algo.prompts_per_step=8", "reward.fns=[rw_rank:flaky]", "reward.timeout_s=1",
            "reward.max_failure_frac=1", "reward.on_failure=-2", "safety.collective_timeout_s=120", run_dir=run_dir,
            env=rewards, timeout=400)
    rows = train_rows(run_dir)
    assert len(rows) == 2
    assert sum(r["reward/timeouts"] for r in rows) > 0 and sum(r["reward/errors"] for r in rows) > 0, rows
    for r in rows:  # each failed sample scored -2, every other one 1
        failed = (r["reward/timeouts"] + r["reward/errors"]) / 16
        assert r["reward/mean"] == pytest.approx(-2 * failed + (1 - failed)), r
    assert (run_dir / "final").exists()


def test_rank_without_prompts_calls_no_reward(tiny_cache, tmp_path, rewards):
    # One prompt per step (and one eval prompt) on two ranks: rank 1's slices are empty; the
    # reward requires the `answer` column and fails if called without completions.
    run_dir = tmp_path / "run"
    rltrain(*TWO_RANKS, "algo.prompts_per_step=1", "data.num_eval=1", "reward.fns=[rw_rank:needs_answer]",
            "trainer.eval_every=1", run_dir=run_dir, env=rewards, timeout=400)
    rows = train_rows(run_dir)
    assert len(rows) == 2 and all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
