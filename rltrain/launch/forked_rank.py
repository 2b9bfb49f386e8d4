"""A rank or rollout process forked from a server that has already imported torch and transformers
(tests only).

A fresh `python -m rltrain.worker` (or `rltrain.rollout.separate_child`, or a launcher-started
`python -m rltrain`: a torchrun rank, the SFT start's run) spends seconds of CPU on imports, most
of a short run's time; the test suite runs hundreds of short runs. With `RLTRAIN_RANK_SERVER`
naming a rank server's socket (tests/rank_server.py) the process is only a stand-in: the server
forks the real one with the stand-in's argv, environment, cwd, sys.path and fds, the stand-in
forwards signals and exits as the real process did, and the server kills one whose stand-in dies.
Unset (every user run), nothing here runs. Protocol and story: docs/testing.md, "Warm ranks".
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


def run_in_server(path: str, entry: str, args: list[str], fds: tuple[int, ...] = (0, 1, 2)) -> None:
    """Be the stand-in of the process that the server at `path` forks to call `entry`
    ("module:function") with `args` and exit with its result, holding this process's `fds` under the
    same numbers; exit as that process exits. Or return at once when the server declines (an
    environment its libraries were not imported with): this process then does the work itself."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # no server (any more): this process does the work
        sock.close()
        return
    # The environment keeps RANK_SERVER_ENV: what the forked process starts (a rank's separate
    # rollout process) is forked too; the server calls `entry` directly, so it does not recurse.
    request = {"argv": sys.argv, "entry": entry, "args": args, "fds": list(fds), "env": dict(os.environ),
               "cwd": os.getcwd(), "sys_path": sys.path, "parent": os.getpid()}
    send_message(sock, request, list(fds))
    reader = LineReader(sock)
    started = reader.next()
    if started is not None and "cold" in started:
        sock.close()
        return
    if started is None or "pid" not in started:
        sys.stderr.write(f"rltrain: the rank server at {path} did not start {entry}\n")
        os._exit(1)
    for fd in fds:
        if fd > 2:  # the forked process holds it now: its end of a socket closes when that process ends
            os.close(fd)
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
