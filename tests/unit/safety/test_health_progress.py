"""`/healthz/deep` is honest: ranks are judged by step progress, not by the beat thread's pulse; the
server bounds request time and concurrent connections; one ping at a time."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

from rltrain.safety.health import HealthServer
from rltrain.safety.heartbeat import FIRST_STEP_FACTOR, Heartbeat, describe_lost_peers, rank_status


def _get(port: int, path: str = "/healthz/deep") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_beating_rank_without_step_progress_is_stuck(tmp_path):
    stale = 0.5
    beat = Heartbeat(tmp_path, 0, interval_s=0.05)  # the pulse stays fresh throughout
    beat.start()
    try:
        # Before the first completed step the limit is FIRST_STEP_FACTOR x stale_after_s.
        assert FIRST_STEP_FACTOR * stale > 1.0
        time.sleep(0.8)
        ok, text = rank_status(tmp_path, 0, stale_after_s=stale)
        assert ok, text
        time.sleep(FIRST_STEP_FACTOR * stale - 0.8 + 0.3)
        ok, text = rank_status(tmp_path, 0, stale_after_s=stale)
        assert not ok and "stuck: its first step has not completed" in text and "its process is alive" in text

        beat.beat(1)
        beat.beat(1, finished=True)
        ok, text = rank_status(tmp_path, 0, stale_after_s=stale)
        assert ok and "last progress" in text
        time.sleep(stale + 0.3)
        record = json.loads(beat.path.read_text())
        assert record["steps_done"] == 1 and record["time"] > record["progress_time"] + stale
        ok, text = rank_status(tmp_path, 0, stale_after_s=stale)
        assert not ok and "stuck: no step completed for" in text and "step 1, last finished 1" in text
        # A survivor naming lost peers after a failed collective does not count waiting as lost.
        assert describe_lost_peers(tmp_path, world_size=2, rank=1, stale_after_s=stale).startswith("no peer looks dead")
    finally:
        beat.stop()


def test_deep_check_turns_503_when_steps_stop_while_the_beat_goes_on(tmp_path):
    beat = Heartbeat(tmp_path, 0, interval_s=0.1)
    beat.start()
    server = HealthServer(tmp_path, world_size=1, stale_after_s=1.0, port=0)
    port = server.start()
    try:
        beat.beat(1, finished=True)
        assert _get(port)[0] == 200
        time.sleep(1.5)  # no step completes; the beat thread still writes every 0.1 s
        code, body = _get(port)
        assert code == 503 and "stuck: no step completed" in body["dead"][0]
        beat.beat(2, finished=True)
        assert _get(port)[0] == 200
    finally:
        server.stop()
        beat.stop()


def test_idle_connections_time_out_and_are_capped(tmp_path):
    beat = Heartbeat(tmp_path, 0)
    beat.start()
    server = HealthServer(tmp_path, world_size=1, stale_after_s=60, port=0, request_timeout_s=1.0, max_connections=2)
    port = server.start()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # send nothing
    try:
        time.sleep(0.3)
        # Both handler slots are held by silent clients: a third connection gets 503 at once.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            extra.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.0 503") and b"too many concurrent health requests" in reply
        # The socket timeout frees the slots: the silent clients are closed by the server.
        for conn in idle:
            conn.settimeout(5)
            assert conn.recv(4096) == b""  # closed by the server after request_timeout_s
        time.sleep(0.2)  # the slot is released just after the close
        assert _get(port, "/healthz") == (200, {"status": "ok"})
    finally:
        for conn in idle:
            conn.close()
        server.stop()
        beat.stop()


def test_one_ping_at_a_time_and_a_wedged_one_is_reported_not_repeated(tmp_path):
    beat = Heartbeat(tmp_path, 0)
    beat.start()
    release = threading.Event()
    calls: list[int] = []

    def wedged_ping():
        calls.append(1)
        release.wait(30)
        return True

    server = HealthServer(tmp_path, world_size=1, stale_after_s=60, port=0, ping=wedged_ping, ping_timeout_s=0.3)
    port = server.start()
    try:
        code, body = _get(port)
        assert code == 503 and "no answer to ping within 0.3 s" in body["rollout"]
        code, body = _get(port)
        assert code == 503 and "still waiting" in body["rollout"]
        assert calls == [1]  # the second probe did not start another ping
        release.set()
        time.sleep(0.2)
        assert _get(port)[0] == 200 and calls == [1, 1]
    finally:
        release.set()
        server.stop()
        beat.stop()
