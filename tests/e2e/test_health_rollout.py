"""`/healthz/deep` asks the real rollout engine: a GRPO run whose separate engine process is killed
answers 503 naming the rollout engine (docs/failure-behaviour.md, "Health endpoints and the hang watchdog")."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cli import QUICK, BackgroundRun

# Separate-engine runs create rlsep-* directories and /dev/shm segments that the cleanup checks
# count: one pytest-xdist worker runs them all, one after the other (docs/testing.md, "Start-up").
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("separate_engine")]

# Step 2's reward call parks the training loop outside the engine until the test has probed (it
# writes the release file), so the probe sees the dead engine before the next engine call ends the run.
REWARD = """
    import os, pathlib, time

    calls = [0]

    def slow_second_step(prompts, completions, **columns):
        calls[0] += 1
        if calls[0] == 2:
            pathlib.Path(os.environ["RLTRAIN_TEST_MARK"]).write_text("rewarding")
            release = pathlib.Path(os.environ["RLTRAIN_TEST_RELEASE"])
            deadline = time.monotonic() + 20
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return [0.0] * len(completions)
"""


def _deep(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/deep", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _engine_child(parent: int) -> int:
    """The pid of `parent`'s child running rltrain.rollout.separate_child."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"rltrain.rollout.separate_child" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no rollout child of process {parent}")


def _wait_dead(pid: int, timeout: float) -> None:
    """Until `pid` has exited (a zombie its parent has not reaped yet, or gone): from then on the
    run's `proc.poll()` sees the exit. A warm run's stand-in dies at once, but the engine the rank
    server forked for it lives until the server notices, and could answer a ping sent in between."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout:g} s after SIGKILL"
        time.sleep(0.01)


def test_killed_separate_engine_turns_deep_health_503_naming_it(tiny_cache, tmp_path):
    """A warm run (`cli.BackgroundRun`): its rollout process is a stand-in whose engine the rank
    server forked; SIGKILL to the stand-in ends that engine too, and the run sees the stand-in's
    exit as it would the engine's own (tests/rank_server.py)."""
    (tmp_path / "slowreward.py").write_text(textwrap.dedent(REWARD))
    mark, release = tmp_path / "mark", tmp_path / "release"
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": str(tmp_path), "RLTRAIN_TEST_MARK": str(mark), "RLTRAIN_TEST_RELEASE": str(release)}
    sockets_before = set(Path(tempfile.gettempdir()).glob("rlsep-*"))
    run = BackgroundRun([
        "algo=grpo", "rollout=vllm", "rollout.process=separate", *QUICK,
        "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=4", "trainer.max_steps=3",
        "reward.fns=[slowreward:slow_second_step]", "health.port=0", "health.ping_timeout_s=2",
    ], run_dir, env)
    try:
        deadline = time.monotonic() + 300
        while not mark.exists():
            assert run.poll() is None, run.finish(timeout=5).stderr[-3000:]
            assert time.monotonic() < deadline, "step 2's reward was never reached"
            time.sleep(0.1)
        port = json.loads((run_dir / "health.json").read_text())["port"]
        code, body = _deep(port)
        assert code == 200 and body["rollout"] == "ok", body  # the live engine answers its ping

        child = _engine_child(run.pid)
        t0 = time.monotonic()
        os.kill(child, signal.SIGKILL)
        _wait_dead(child, timeout=5)
        code, body = _deep(port)
        assert time.monotonic() - t0 < 5
        assert code == 503, body
        assert body["dead"] == [f"rollout engine: ping failed: RolloutProcessError: the rollout process (pid {child}) "
                                "exited with code -9"], body
        assert set(body["ranks"]) == {"0"} and body["ranks"]["0"].startswith("rank 0: alive")
        release.write_text("probed")

        done = run.finish(timeout=120)  # the next engine call ends the run, naming the process
        assert done.returncode != 0
        assert "rollout process" in done.stderr and "exit code -9" in done.stderr, done.stderr[-3000:]
        assert set(Path(tempfile.gettempdir()).glob("rlsep-*")) <= sockets_before  # the failed engine removed its sockets
    finally:
        run.close()
