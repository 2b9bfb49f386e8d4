"""A rank forked from a server that has already imported torch and transformers (tests only).

A fresh `python -m rltrain.worker` spends seconds of CPU importing torch and transformers, most of a
short run's time; the test suite runs hundreds of short runs. With `RLTRAIN_RANK_SERVER` naming a
rank server's socket (tests/rank_server.py) the worker is only a stand-in: the server forks the real
rank with the stand-in's argv, environment, cwd, sys.path and fds 0-2, the stand-in forwards the
agent's signals and exits as the rank did, and the server kills a rank whose stand-in dies. Unset
(every user run), nothing here runs. Protocol (JSON lines) and story: docs/testing.md, "Warm ranks".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from typing import Any

RANK_SERVER_ENV = "RLTRAIN_RANK_SERVER"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = (json.dumps(message) + "\n").encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


class LineReader:
    """JSON lines from a socket (a message may arrive in pieces)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def next(self) -> dict[str, Any] | None:
        """The next message; None when the peer closed the connection."""
        while b"\n" not in self.buffer:
            try:
                chunk = self.sock.recv(65536)
            except InterruptedError:
                continue
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def run_in_server(path: str, argv: list[str]) -> None:
    """Be the stand-in of a rank that the server at `path` forks, and exit as that rank exits; or
    return at once when the server declines (an environment its libraries were not imported
    with): this process is then the rank."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # no server (any more): this process is the rank
        sock.close()
        return
    env = {k: v for k, v in os.environ.items() if k != RANK_SERVER_ENV}
    request = {"argv": argv, "env": env, "cwd": os.getcwd(), "sys_path": sys.path, "parent": os.getpid()}
    send_message(sock, request, [0, 1, 2])
    reader = LineReader(sock)
    started = reader.next()
    if started is not None and "cold" in started:
        sock.close()
        return
    if started is None or "pid" not in started:
        sys.stderr.write(f"rltrain: the rank server at {path} did not start the rank\n")
        os._exit(1)
    rank_pid = int(started["pid"])
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: _forward(rank_pid, signum))
    ended = reader.next()
    code = int(ended["exit"]) if ended is not None and "exit" in ended else 1
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)  # not reached unless the signal does not end a process
    os._exit(code)


def _forward(pid: int, signum: int) -> None:
    """To the rank's process group, as the agent's `killpg` of a rank reaches what it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
