"""`env=openenv` end to end (docs/environments.md, "OpenEnv"): an OpenEnv environment written against
openenv-core's own API (tests/ecosystems/openenv_answer.py) hosted by the run, one instance per
episode in its workers, or served by OpenEnv's own server and reached by URL. The reply fills the
Action's one text field, the observation is the next turn, the step results the reward; an
environment that raises, hangs or returns garbage costs its own episodes (`env/errors`,
`env/timeouts`), never the run. The default suite runs one: GRPO, HF engine, one rank, the class
hosted, every fault; the engine/rank/algorithm matrix and the server by URL are `slow`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from cli import ROOT, SMALL_MODEL, read_metrics, rltrain, train_rows

pytestmark = pytest.mark.e2e

ENVS = ROOT / "tests" / "ecosystems"
PATH_ENV = {"PYTHONPATH": str(ENVS)}
FAULTS = ["", "raise", "", "hang", "", "garbage", "", ""]


def write_rows(root):
    """Questions the tiny model rarely answers; a row's `fault` makes the environment fail on it. The
    training set is the 8 rows of one step (each step plays every fault), held-out rows apart."""
    for name, first in (("rows.jsonl", 0), ("eval.jsonl", 50)):
        rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "fault": FAULTS[i % 8]} for i in range(first, first + 8)]
        (root / name).write_text("\n".join(json.dumps(r) for r in rows))
    return root


def openenv_run(root, *extra):
    return [
        "algo=grpo", "model=tiny", *SMALL_MODEL, "env=openenv", "env.max_turns=2", "env.timeout_s=2",
        "env.max_tokens_per_turn=8", f"data.path={root / 'rows.jsonl'}", f"data.eval_path={root / 'eval.jsonl'}",
        "reward.max_failure_frac=1.0", "algo.prompts_per_step=8", "algo.group_size=2", "trainer.max_steps=2", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=lines", "logger.wandb.mode=disabled", *extra,
    ]


def check_rows(run_dir, steps=2, faults=True):
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert 1.0 <= r["env/turns_mean"] <= 2.0, r
        assert r["rollout/logprob_diff_max"] < 1e-2, r
        assert "reward/env" in r and r["reward/mean"] == pytest.approx(r["reward/env"]), r
        # Each wrong answer scores 0.1 per step taken (the environment's own reward): a played episode scores > 0.
        assert r["reward/env"] > 0.0, r
    if faults:
        # Every step plays the 8 rows twice (group_size 2): `raise` and `garbage` are 4 errors, `hang` 2 timeouts.
        assert all(r["env/errors"] == 4.0 and r["env/timeouts"] == 2.0 for r in rows), rows
    return rows


def test_a_hosted_openenv_environment_trains_and_its_faults_cost_only_their_episodes(tmp_path):
    """One step, no held-out pass (the slow runs below evaluate): most of its time is the workers'
    import of openenv-core (gradio with it), paid again by the two a hung step's kill starts."""
    root = write_rows(tmp_path)
    rltrain(*openenv_run(root, "rollout=hf", "trainer.max_steps=1", "env.cls=openenv_answer:AnswerEnvironment", "data.eval_path=null"),
            run_dir=tmp_path / "run", timeout=400, env=PATH_ENV)
    check_rows(tmp_path / "run", steps=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def answer_server():
    """OpenEnv's own server (create_app under uvicorn) for AnswerEnvironment, in a process of its own."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "openenv_answer:app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ENVS, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_an_openenv_server_by_url_trains_and_its_faults_cost_only_their_episodes(tmp_path, answer_server):
    root = write_rows(tmp_path)
    rltrain(*openenv_run(root, "rollout=hf", f"env.url={answer_server}"), run_dir=tmp_path / "run", timeout=400, env=PATH_ENV)
    check_rows(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "rollout", "nproc"),
    [("grpo", "vllm", 1), ("ppo", "hf", 1), ("ppo", "vllm", 2), ("grpo", "hf", 2), ("grpo", "vllm", 2)],
)
def test_openenv_runs_on_each_engine_rank_count_and_algorithm(tmp_path, algo, rollout, nproc):
    root = write_rows(tmp_path)
    rltrain(*openenv_run(root, f"algo={algo}", f"rollout={rollout}", f"trainer.nproc={nproc}", "trainer.eval_every=2",
                         "env.cls=openenv_answer:AnswerEnvironment"),
            run_dir=tmp_path / "run", timeout=500, env=PATH_ENV)
    check_rows(tmp_path / "run")
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/reward" in r]
    assert evals and all(0.0 <= r["eval/success"] <= 1.0 for r in evals)
