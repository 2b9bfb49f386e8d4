"""The rank server of warm CLI runs: a child of the tests' fork server (`run`, started by
tests/cli.py `rank_server`), so it holds the libraries every rank imports (helpers.PRELOAD).

It forks a process for each stand-in that connects (rltrain.launch.forked_rank has the protocol and
the stand-in's side; `{"count": true}` asks how many it forked): a rank of `python -m
rltrain.worker` or a separate rollout process, with the stand-in's argv, environment, working
directory, sys.path and descriptors, in a session of its own (as the agent's `start_new_session`
gives a rank). It is SIGKILLed, with its process group, when its stand-in goes away, and when this
server dies. Single-threaded: a select loop over the listening socket, the stand-ins' connections
and the forked processes' pidfds, so every fork happens with one thread. docs/testing.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import json
import os
import selectors
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1
# What a rank's environment may hold that the server's does not, besides helpers.WARM_ENV_PREFIXES
# (read only by rltrain, by libraries not preloaded, or on use): what the elastic agent sets for
# each rank (torch reads none of them on import). Any other difference starts the rank cold.
AGENT_ENV_PREFIXES = ("TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING")
SERVER_ENV: dict[str, str] = {}  # the server's environment (`run`)


def die_with(parent_pid: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


class StandIn:
    """One connection: the request being read, then the rank it started."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer, self.fds = conn, b"", []
        self.rank_pid: int | None = None
        self.pidfd: int | None = None


def read_request(client: StandIn) -> dict | None:
    """The request once its line is complete (None until then); raises EOFError on a closed peer."""
    data, fds, _flags, _addr = socket.recv_fds(client.conn, 1 << 20, 8)
    if not data:
        raise EOFError
    client.fds += fds
    client.buffer += data
    if b"\n" not in client.buffer:
        return None
    return json.loads(client.buffer.split(b"\n", 1)[0])


def become_rank(request: dict, fds: list[int], listener: socket.socket, conns: list[socket.socket]) -> None:
    """In the forked child: turn into the process the stand-in stands for (a rank, a separate
    rollout process) and exit as `python -m ...` would: `entry(*args)`'s result is the status."""
    from helpers import run_as_interpreter

    listener.close()
    for c in conns:
        c.close()
    os.setsid()
    die_with(int(request["server"]))
    # Out of the way first: a received descriptor may hold a number another one is going to.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fds"], moved, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the interpreter's own streams
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = request["sys_path"]
    sys.argv = list(request["argv"])
    module, function = request["entry"].split(":")

    def main() -> None:
        sys.exit(getattr(importlib.import_module(module), function)(*request["args"]))

    run_as_interpreter(main)


def send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(message) + "\n").encode())


def serve(listener: socket.socket) -> None:
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    clients: dict[int, StandIn] = {}  # by connection fd
    while True:
        for key, _ in selector.select():
            if key.data is None:
                conn, _ = listener.accept()
                client = StandIn(conn)
                clients[conn.fileno()] = client
                selector.register(conn, selectors.EVENT_READ, ("conn", client))
                continue
            kind, client = key.data
            if kind == "pidfd":
                finish(client, selector, clients)
            elif client.rank_pid is None:
                try:
                    request = read_request(client)
                except (EOFError, OSError):
                    close(client, selector, clients)
                    continue
                if request is not None:
                    start(client, request, listener, selector, clients)
            else:  # the stand-in went away (its only message was the request): its rank goes too
                with contextlib.suppress(OSError):
                    if client.conn.recv(1):
                        continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(client.rank_pid, signal.SIGKILL)
                selector.unregister(client.conn)
                client.conn.close()


FORKED = [0]  # ranks forked so far (a request {"count": true} asks; tests/e2e/test_warm_runs.py)


def start(client: StandIn, request: dict, listener: socket.socket, selector, clients: dict[int, StandIn]) -> None:
    if request.get("count"):
        send(client.conn, {"forked": FORKED[0]})
        close(client, selector, clients)
        return
    from helpers import WARM_ENV_PREFIXES

    allowed = WARM_ENV_PREFIXES + AGENT_ENV_PREFIXES
    differing = sorted(k for k in set(request["env"]) | set(SERVER_ENV)
                       if request["env"].get(k) != SERVER_ENV.get(k) and not k.startswith(allowed))
    if differing:  # a preloaded library may have read one of them: the rank starts cold
        send(client.conn, {"cold": differing})
        close(client, selector, clients)
        return
    request["server"] = os.getpid()
    pid = os.fork()
    if pid == 0:
        become_rank(request, client.fds, listener, [c.conn for c in clients.values()])
    for fd in client.fds:
        os.close(fd)
    client.fds = []
    client.rank_pid = pid
    FORKED[0] += 1
    client.pidfd = os.pidfd_open(pid)
    selector.register(client.pidfd, selectors.EVENT_READ, ("pidfd", client))
    send(client.conn, {"pid": pid})


def finish(client: StandIn, selector, clients: dict[int, StandIn]) -> None:
    assert client.rank_pid is not None and client.pidfd is not None
    _, status = os.waitpid(client.rank_pid, 0)
    selector.unregister(client.pidfd)
    os.close(client.pidfd)
    if client.conn.fileno() >= 0:
        send(client.conn, {"exit": os.waitstatus_to_exitcode(status)})
    close(client, selector, clients)


def close(client: StandIn, selector, clients: dict[int, StandIn]) -> None:
    fileno = client.conn.fileno()
    if fileno >= 0:
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(client.conn)
        client.conn.close()
        clients.pop(fileno, None)
    for fd in client.fds:
        os.close(fd)
    client.fds = []


def run(path: str) -> None:
    """The server's process: a child of the tests' fork server (helpers.rank_context), which has
    imported PRELOAD and holds the session's environment; it ends with that fork server."""
    SERVER_ENV.clear()
    SERVER_ENV.update(os.environ)
    die_with(os.getppid())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    serve(listener)
