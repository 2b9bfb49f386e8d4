"""rltrain/rollout/server/guard.py: a spawned server's guard stops its server on SIGTERM, without
waiting out its grace when the server ends at once, and kills a server that ignores the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rltrain.rollout.server.guard import GRACE_S, session_members


def guarded(tmp_path, server_code: str) -> subprocess.Popen:
    ready = tmp_path / "ready"
    code = f"import pathlib, signal, sys, time\n{server_code}\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(100)"
    guard = subprocess.Popen([sys.executable, "-m", "rltrain.rollout.server.guard", str(os.getpid()), sys.executable, "-c", code],
                             start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert guard.poll() is None and time.monotonic() < deadline, "the guarded server did not start"
        time.sleep(0.02)
    return guard


def test_a_server_that_ends_on_sigterm_is_stopped_without_the_grace(tmp_path):
    said = tmp_path / "said"
    guard = guarded(tmp_path, f"signal.signal(signal.SIGTERM, lambda *a: (open({str(said)!r}, 'w').write('term'), sys.exit(0)))")
    started = time.monotonic()
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(timeout=30) == 0
    assert time.monotonic() - started < GRACE_S, "the guard waited out its grace for a server that had ended"
    assert said.read_text() == "term" and session_members(guard.pid) == []


def test_a_server_that_ignores_sigterm_is_killed_with_its_session_after_the_grace(tmp_path):
    guard = guarded(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(timeout=30) == 0
    assert session_members(guard.pid) == []
