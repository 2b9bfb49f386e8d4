"""Health endpoints over real sockets on 127.0.0.1, heartbeats, and the hang watchdog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rltrain.safety.health import HealthServer
from rltrain.safety.heartbeat import Heartbeat, describe_lost_peers, heartbeat_path, rank_status
from rltrain.safety.watchdog import HANG_EXIT_CODE

ROOT = Path(__file__).resolve().parents[3]


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _fake_rank(run_dir: Path, rank: int, age_s: float = 0.0, pid: int | None = None) -> None:
    path = heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    import socket

    record = {"rank": rank, "pid": pid or os.getpid(), "host": socket.gethostname(), "time": time.time() - age_s, "step": 4, "finished_step": 3}
    path.write_text(json.dumps(record))


def test_endpoints_follow_heartbeats_and_the_rollout_ping(tmp_path):
    alive = {"rollout": True}

    def ping():
        if not alive["rollout"]:
            raise ConnectionError("engine core died")
        return True

    beat = Heartbeat(tmp_path, 0, interval_s=0.2)
    beat.start()
    _fake_rank(tmp_path, 1)
    server = HealthServer(tmp_path, world_size=2, stale_after_s=5.0, port=0, ping=ping, ping_timeout_s=2.0)
    port = server.start()
    try:
        assert _get(port, "/healthz") == (200, {"status": "ok"})
        code, body = _get(port, "/healthz/deep")
        assert code == 200 and body["status"] == "ok" and body["dead"] == [] and set(body["ranks"]) == {"0", "1"}

        alive["rollout"] = False  # the rollout engine dies: deep health turns 503 and says so
        code, body = _get(port, "/healthz/deep")
        assert code == 503 and body["status"] == "unhealthy"
        assert any("rollout engine" in d and "engine core died" in d for d in body["dead"])
        assert _get(port, "/healthz")[0] == 200  # the process itself is alive

        alive["rollout"] = True
        _fake_rank(tmp_path, 1, age_s=30.0)  # rank 1 goes silent
        code, body = _get(port, "/healthz/deep")
        assert code == 503 and body["dead"] == [body["ranks"]["1"]] and "heartbeat 30" in body["dead"][0]
        assert _get(port, "/nope")[0] == 404
    finally:
        server.stop()
        beat.stop()


def test_a_rank_that_has_not_beaten_yet_is_starting_until_the_stale_limit(tmp_path):
    """Rank 0 serves as soon as its own beat runs; a peer a moment behind is not reported dead."""
    _fake_rank(tmp_path, 0)
    server = HealthServer(tmp_path, world_size=2, stale_after_s=5.0, port=0)
    port = server.start()
    try:
        code, body = _get(port, "/healthz/deep")
        assert code == 200 and body["dead"] == [], body
        assert body["ranks"]["1"].startswith("rank 1: starting (no heartbeat yet, "), body
    finally:
        server.stop()
    since = server.started
    assert rank_status(tmp_path, 1, 5.0, now=since + 5.0, watched_since=since)[0]
    assert rank_status(tmp_path, 1, 5.0, now=since + 5.5, watched_since=since) == (False, "rank 1: no heartbeat")


def test_a_hung_ping_fails_the_deep_check_in_bounded_time(tmp_path):
    _fake_rank(tmp_path, 0)
    server = HealthServer(tmp_path, world_size=1, stale_after_s=5.0, port=0, ping=lambda: time.sleep(30), ping_timeout_s=0.5)
    port = server.start()
    try:
        t0 = time.monotonic()
        code, body = _get(port, "/healthz/deep")
        assert code == 503 and "no answer to ping within 0.5 s" in body["dead"][0]
        assert time.monotonic() - t0 < 5
    finally:
        server.stop()


def test_dead_process_is_named(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    _fake_rank(tmp_path, 1, pid=proc.pid)
    ok, text = rank_status(tmp_path, 1, stale_after_s=60)
    assert not ok and f"process {proc.pid} is gone" in text
    assert describe_lost_peers(tmp_path, world_size=2, rank=0).startswith("lost rank 1: process")
    assert rank_status(tmp_path, 2, 60) == (False, "rank 2: no heartbeat")


def test_watchdog_dumps_the_stack_and_exits_non_zero(tmp_path):
    script = textwrap.dedent(
        f"""
        import time
        from rltrain.safety.watchdog import Watchdog
        Watchdog({str(tmp_path)!r}, rank=0, timeout_s=1.0, poll_s=0.1, grace_s=0.2).start()
        def stuck_in_a_collective():
            time.sleep(60)
        stuck_in_a_collective()
        """
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == HANG_EXIT_CODE
    assert time.monotonic() - t0 < 30
    stack = (tmp_path / "stacks" / "rank-0.txt").read_text()
    assert "stuck_in_a_collective" in stack and "no training step completed" in stack
    assert "hang watchdog" in proc.stderr


@pytest.mark.parametrize("fresh", [True, False])
def test_watchdog_obeys_a_fresh_peer_request_only(tmp_path, fresh):
    from rltrain.safety.watchdog import Watchdog

    stacks = tmp_path / "stacks"
    stacks.mkdir()
    request = stacks / "REQUEST"
    request.write_text("rank 1: no training step completed\n")
    if not fresh:
        os.utime(request, (time.time() - 3600, time.time() - 3600))  # left over from an earlier run
    dog = Watchdog(tmp_path, rank=0, timeout_s=60)
    assert dog._fresh_request() is fresh
