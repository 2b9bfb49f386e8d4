"""A process that a warm run's launcher starts, handed to the rank server (docs/testing.md, "Warm
ranks"): its stand-in side, and the protocol both sides speak.

A fresh `python -m rltrain.worker` (or a separate rollout process, or a launcher-started
`python -m rltrain`: a torchrun rank, the SFT start's run) spends seconds of CPU on imports, most of
a short run's time. Under a warm run such a process is only a stand-in: at interpreter start-up,
before its module is imported (tests/stand_in_site/sitecustomize.py, on the PYTHONPATH that
`environment` gives), it sends the rank server (tests/rank_server.py) its command line, environment,
working directory, sys.path and descriptors; the server forks a process that runs the same command
as `__main__`, and the stand-in forwards signals to it and exits as it exits. The product is
reached only through its entry points: it holds no trace of this.

Protocol, JSON lines over a Unix socket: the stand-in sends {"argv", "fds", "env", "cwd",
"sys_path", "parent_named_in"} with the descriptors `fds` names attached; the server answers
{"pid": N} once the process runs and {"exit": code} (negative: the signal that killed it) when it
ended, or {"cold": [names]} when the environment differs where a preloaded library reads it (the
stand-in then runs the command itself, a fresh interpreter).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

RANK_SERVER_ENV = "RLTRAIN_RANK_SERVER"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_in_site")
# rltrain's variable naming the process a run started by a run (the SFT start) dies with
# (rltrain.runtime.parent_death; tests/e2e/test_warm_runs.py holds the two names equal).
DIE_WITH_PARENT_ENV = "RLTRAIN_DIE_WITH_PARENT"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def environment(server: str, env: dict[str, str]) -> dict[str, str]:
    """The variables under which the rltrain processes that a process with `env` launches are
    stand-ins for processes forked by the rank server at `server`."""
    path = env.get("PYTHONPATH", "")
    if SITE_DIR not in path.split(os.pathsep):
        path = os.pathsep.join(filter(None, [SITE_DIR, path]))
    return {RANK_SERVER_ENV: server, "PYTHONPATH": path}


def die_with(parent_pid: int) -> None:
    """SIGKILL this process when its parent, `parent_pid`, dies; exit 1 now if it already has (as
    rltrain.runtime.parent_death does for a rank)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


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


@dataclasses.dataclass
class Launched:
    """A process an rltrain launcher started: its command (`python *argv`), the process it dies with
    (None: none), the descriptors it holds, and where its command names that process."""

    argv: list[str]
    dies_with: int | None
    fds: tuple[int, ...] = (0, 1, 2)
    parent_named_in: list[Any] | None = None


def launched_by_rltrain(argv: list[str], orig_argv: list[str], environ: Mapping[str, str]) -> Launched | None:
    """What this process is, from its `sys.argv` at start-up (`-m`'s is ["-m", *args]) and
    `sys.orig_argv`, if an rltrain launcher started it; None for any other (a user's launcher too)."""
    if argv[:1] != ["-m"]:
        return None
    module, args = orig_argv[-len(argv)], argv[1:]
    command = ["-m", module, *args]
    if module == "rltrain.worker":  # RUN_DIR LAUNCHER_PID
        return Launched(command, int(args[1]), parent_named_in=["argv", 3])
    if module == "rltrain" and "TORCHELASTIC_RUN_ID" in environ:  # a torchrun rank: dies with torchrun
        return Launched(command, os.getppid())
    if module == "rltrain" and DIE_WITH_PARENT_ENV in environ:  # the SFT start's run
        return Launched(command, int(environ[DIE_WITH_PARENT_ENV]), parent_named_in=["env", DIE_WITH_PARENT_ENV])
    if module == "rltrain.rollout.separate_child":  # SPEC_JSON, with its control socket inherited
        return Launched(command, None, fds=(0, 1, 2, int(json.loads(args[0])["control_fd"])))
    if module == "rltrain.runtime.call_worker":  # IN OUT PARENT_PID (a CallPool's), with its two pipe ends
        return Launched(command, int(args[2]), fds=(0, 1, 2, int(args[0]), int(args[1])), parent_named_in=["argv", 4])
    return None


def stand_in_if_launched() -> None:
    """At start-up of a process under a warm run: be the stand-in if an rltrain launcher started it,
    doing first what its entry point does first (die with its launcher); otherwise return."""
    server = os.environ.get(RANK_SERVER_ENV)
    launched = launched_by_rltrain(sys.argv, sys.orig_argv, os.environ) if server else None
    if server is None or launched is None:
        return
    if launched.dies_with is not None:
        die_with(launched.dies_with)
    # A fresh interpreter puts the working directory first on sys.path for `-m`, after start-up.
    sys_path = sys.path if sys.flags.safe_path else [os.getcwd(), *sys.path]
    run_in_server(server, launched.argv, sys_path, launched.fds, launched.parent_named_in)


def run_in_server(path: str, argv: list[str], sys_path: list[str], fds: tuple[int, ...] = (0, 1, 2),
                  parent_named_in: list[Any] | None = None) -> None:
    """Be the stand-in of the process that the server at `path` forks to run `python *argv`, holding
    this process's `fds` under the same numbers; exit as that process exits. Or return at once when
    there is no server or it declines (an environment its libraries were not imported with): this
    process then runs the command itself. `parent_named_in` says where the command names the process
    it dies with: in the forked process, the server that forked it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return
    # The environment keeps RANK_SERVER_ENV: what the forked process starts (a rank's separate
    # rollout process) is forked too.
    request = {"argv": argv, "fds": list(fds), "env": dict(os.environ), "cwd": os.getcwd(), "sys_path": sys_path,
               "parent_named_in": parent_named_in}
    send_message(sock, request, list(fds))
    reader = LineReader(sock)
    started = reader.next()
    if started is not None and "cold" in started:
        sock.close()
        return
    if started is None or "pid" not in started:
        sys.stderr.write(f"tests/stand_in.py: the rank server at {path} did not start {' '.join(argv)}\n")
        os._exit(1)
    for fd in fds:
        if fd > 2:  # the forked process holds it now: its end of a socket closes when that process ends
            os.close(fd)
    pid = int(started["pid"])
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    ended = reader.next()
    code = int(ended["exit"]) if ended is not None and "exit" in ended else 1
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)  # not reached unless the signal does not end a process
    os._exit(code)


def _forward(pid: int, signum: int) -> None:
    """To the forked process's group, as the agent's `killpg` of a rank reaches what it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
