"""`env=python` end to end (docs/environments.md): GRPO on two ranks with the vLLM engine plays
multi-turn episodes of the built-in retry environment in worker processes; the model's tokens keep
their engine log-probabilities through the turns (train/rollout parity in fp32), the episode metrics
are logged, and held-out episodes are evaluated. A configuration this release cannot run multi-turn
is refused before anything is built."""

from __future__ import annotations

import pytest
from cli import SMALL_MODEL, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

ENV_RUN = [
    "algo=grpo", "model=tiny", *SMALL_MODEL, "env=python", "env.cls=rltrain.envs.retry:AdditionWithRetries",
    "env.max_turns=3", "algo.prompts_per_step=4", "algo.group_size=2", "data.num_eval=4", "trainer.max_steps=2",
    "trainer.log_every=1", "trainer.eval_every=2", "trainer.save_every=0", "trainer.progress=lines",
    "trainer.nproc=2", "logger.wandb.mode=disabled",
]


def test_grpo_trains_on_multi_turn_episodes_on_two_ranks(tiny_cache, tmp_path):
    rltrain(*ENV_RUN, run_dir=tmp_path / "run", timeout=400)
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # The random tiny model rarely answers right: most episodes take every turn.
        assert 1.0 < r["env/turns_mean"] <= 3.0, r
        assert r["env/timeouts"] == r["env/errors"] == 0.0
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # every sampled token, whatever turn it came from
        assert "reward/env" in r and r["reward/mean"] == pytest.approx(r["reward/env"])
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/reward" in r]
    assert evals and all("eval/accuracy" not in r for r in evals)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["algo=ppo"], "PPO's critic and GAE over interleaved observations are not implemented yet"),
        (["reward.fns=[rltrain.rewards.builtin:exact_match]"], "reward.fns and reward_model are not called"),
        (["env.cls=no_colon"], "env=python needs env.cls=package.module:Class"),
        (["env.max_turns=0"], "env.max_turns=0 must be at least 1"),
    ],
)
def test_what_env_python_cannot_run_is_refused_by_name(tiny_cache, tmp_path, override, message):
    proc = rltrain(*ENV_RUN, *override, run_dir=tmp_path / "run", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
