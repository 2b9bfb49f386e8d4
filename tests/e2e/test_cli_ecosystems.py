"""reasoning-gym and TextArena end to end (docs/environments.md): `data=reasoning_gym` trains with
each row's own dataset's verifier and reports `eval/accuracy/<task>`; `env=textarena` plays a real
TicTacToe against a fixed opponent, in the slow matrix one that raises, hangs and returns garbage
(tests/ecosystem_opponents.py), which costs its own games (`env/errors`, `env/timeouts`), never the
run. One cheap run of each in `make test`; the matrix (vLLM and HF, 1 and 2 ranks, GRPO and PPO) is
`slow`; the mechanisms themselves are unit-tested (tests/unit/data/test_reasoning_gym.py,
tests/unit/envs/test_textarena.py: self-play, faults, replay, NLTK)."""

from __future__ import annotations

import os

import pytest
from cli import QUICK, ROOT, SMALL_MODEL, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

GYM_RUN = [
    *QUICK, *SMALL_MODEL, "algo=grpo", "data=reasoning_gym",
    "data.tasks=[{name:chain_sum,size:200,max_terms:2,max_digits:1},{name:spell_backward,size:100,weight:0.5}]",
    "data.num_eval=6", "algo.prompts_per_step=2", "algo.group_size=2", "algo.max_new_tokens=6",
    "trainer.max_steps=1", "trainer.eval_every=1", "trainer.log_every=1",
]
ARENA_RUN = [
    *QUICK, *SMALL_MODEL, "algo=grpo", "env=textarena", "env.game=TicTacToe-v0", "env.opponent=ecosystem_opponents:faulty",
    "env.policy_seat=1", "env.timeout_s=3", "env.max_concurrency=1", "env.max_turns=2", "env.max_total_tokens=1200",
    "model.max_position_embeddings=2048", "reward.max_failure_frac=1.0", "reward.on_failure=-2",
    "algo.prompts_per_step=2", "algo.group_size=2", "algo.max_new_tokens=4", "data.num_eval=2",
    "trainer.max_steps=1", "trainer.log_every=1",
]


def arena_env(tmp_path) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
            "ECOSYSTEM_OPPONENT_CALLS": str(tmp_path / "opponent_calls")}


def check_gym_run(run_dir, steps: int) -> None:
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert "reward/score_answer" in r and r["reward/errors"] == r["reward/timeouts"] == 0.0, r
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    assert evals
    for r in evals:  # 3 held-out problems per task (data.num_eval=6 shared): the overall accuracy is their mean
        per_task = [r["eval/accuracy/chain_sum"], r["eval/accuracy/spell_backward"]]
        assert r["eval/accuracy"] == pytest.approx(sum(per_task) / 2)


def check_arena_run(run_dir, steps: int) -> None:
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert sum(r["env/errors"] for r in rows) > 0 and sum(r["env/timeouts"] for r in rows) > 0, rows
    assert all("reward/env" in r for r in rows)


def test_reasoning_gym_trains_with_each_tasks_own_verifier(tmp_path):
    rltrain(*GYM_RUN, "rollout=hf", run_dir=tmp_path / "run", timeout=400)
    check_gym_run(tmp_path / "run", 1)


def test_textarena_plays_a_real_game_against_a_fixed_opponent(tmp_path):
    """The cheap run of `make test`: a scripted opponent that plays; its faults are the slow matrix's
    below and tests/unit/envs/test_textarena.py's (real games in real workers)."""
    rltrain(*ARENA_RUN, "rollout=hf", "env.opponent=rltrain.envs.textarena.opponents:first_listed_move",
            run_dir=tmp_path / "run", timeout=400, env=arena_env(tmp_path))
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1]
    # The policy (seat 1) answers the opponent's first move; an invalid reply loses (-1): every game ended by the game.
    assert rows[0]["env/errors"] == rows[0]["env/timeouts"] == 0.0 and rows[0]["rollout/truncated_fraction"] == 0.0, rows
    assert -1.0 <= rows[0]["reward/env"] <= 1.0


MATRIX = [(algo, rollout, nproc) for algo in ("grpo", "ppo") for rollout in ("vllm", "hf") for nproc in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "rollout", "nproc"), [m for m in MATRIX if m != ("grpo", "hf", 1)])
def test_reasoning_gym_matrix(tmp_path, algo, rollout, nproc):
    rltrain(*GYM_RUN, f"algo={algo}", f"rollout={rollout}", f"trainer.nproc={nproc}", "trainer.max_steps=2",
            "algo.prompts_per_step=4", run_dir=tmp_path / "run", timeout=600)
    check_gym_run(tmp_path / "run", 2)


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "rollout", "nproc"), MATRIX)
def test_textarena_matrix(tmp_path, algo, rollout, nproc):
    rltrain(*ARENA_RUN, f"algo={algo}", f"rollout={rollout}", f"trainer.nproc={nproc}", "trainer.max_steps=2",
            "algo.prompts_per_step=4", run_dir=tmp_path / "run", timeout=600, env=arena_env(tmp_path))
    check_arena_run(tmp_path / "run", 2)


@pytest.mark.slow
def test_textarena_self_play_and_a_single_player_game_run(tmp_path):
    """Self-play (both seats the policy's) and a one-player game, on vLLM: the runs finish with the games' rewards."""
    base = [a for a in ARENA_RUN if not a.startswith(("env.opponent", "env.policy_seat", "env.max_concurrency"))]
    rltrain(*base, run_dir=tmp_path / "self", timeout=600)
    rltrain(*base, "env.game=GuessTheNumber-v0", run_dir=tmp_path / "single", timeout=600)
    for run in ("self", "single"):
        rows = train_rows(tmp_path / run)
        assert rows and all(r["env/errors"] == r["env/timeouts"] == 0.0 for r in rows), rows
