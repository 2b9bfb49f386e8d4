"""`/healthz/deep` asks the real rollout engine: a GRPO run whose separate engine process is killed
answers 503 naming the rollout engine (docs/failure-behaviour.md, "Health endpoints and the hang watchdog")."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cli import QUICK, ROOT

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


def test_killed_separate_engine_turns_deep_health_503_naming_it(tiny_cache, tmp_path):
    (tmp_path / "slowreward.py").write_text(textwrap.dedent(REWARD))
    mark, release = tmp_path / "mark", tmp_path / "release"
    run_dir = tmp_path / "run"
    private_tmp = Path(tempfile.mkdtemp(prefix="rlh-", dir="/tmp"))  # short: Unix socket paths live here
    env = dict(os.environ, PYTHONPATH=str(tmp_path), RLTRAIN_TEST_MARK=str(mark),
               RLTRAIN_TEST_RELEASE=str(release), TMPDIR=str(private_tmp))
    cmd = [
        sys.executable, "-m", "rltrain", "algo=grpo", "rollout=vllm", "rollout.process=separate", *QUICK,
        "algo.prompts_per_step=4", "algo.group_size=4", "data.num_eval=4", "trainer.max_steps=3",
        "reward.fns=[slowreward:slow_second_step]", "health.port=0", "health.ping_timeout_s=2",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "step 2's reward was never reached"
            time.sleep(0.1)
        port = json.loads((run_dir / "health.json").read_text())["port"]
        code, body = _deep(port)
        assert code == 200 and body["rollout"] == "ok", body  # the live engine answers its ping

        child = _engine_child(proc.pid)
        os.kill(child, signal.SIGKILL)
        t0 = time.monotonic()
        code, body = _deep(port)
        assert time.monotonic() - t0 < 5
        assert code == 503, body
        assert body["dead"] == [f"rollout engine: ping failed: RolloutProcessError: the rollout process (pid {child}) "
                                "exited with code -9"], body
        assert set(body["ranks"]) == {"0"} and body["ranks"]["0"].startswith("rank 0: alive")
        release.write_text("probed")

        _, err = proc.communicate(timeout=120)  # the next engine call ends the run, naming the process
        assert proc.returncode != 0
        assert "rollout process" in err and "exit code -9" in err, err[-3000:]
        assert list(private_tmp.glob("rlsep-*")) == []  # the failed engine removed its sockets
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(private_tmp, ignore_errors=True)
