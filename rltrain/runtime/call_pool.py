"""User functions called in worker processes that a deadline can stop.

A reward function (or any user callable) may hang, run for minutes in sympy, or crash the
interpreter. A thread cannot be killed, so each call runs in a worker process of its own pool: past
its deadline the worker is SIGKILLed (with whatever it started: it leads its own process group) and
a fresh one takes its place, and the call comes back as a failure for the caller to count. Workers
are plain `python -m rltrain.runtime.call_worker` processes (no re-import of the trainer's main
module), import the named functions before they report ready (so import time never counts against
a call), and die with the trainer (PR_SET_PDEATHSIG). Calls and results cross the pipes as JSON
(no pickle across process boundaries, docs/design.md). docs/rewards-and-roles.md tells the story.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from rltrain.runtime.errors import UserError

STARTUP_S = 120.0  # a worker's interpreter start and imports (a loaded machine is slow)
STOP_S = 5.0


@dataclass
class Call:
    path: str  # `package.module:function`, imported by the worker
    kwargs: dict[str, Any]


@dataclass
class CallResult:
    value: Any = None
    failure: str | None = None  # None: it returned `value`; "timeout", "error" (it raised) or "died"
    message: str = ""


def send(conn: Connection, message: Any) -> None:
    """One JSON message; numpy or torch numbers (what a function may return) as plain numbers."""
    conn.send_bytes(json.dumps(message, default=_plain).encode())


def receive(conn: Connection) -> Any:
    return json.loads(conn.recv_bytes())


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable (reward arguments and results must be plain data)")


class Worker:
    """One worker process and the pipes to it (the parent's ends)."""

    def __init__(self, paths: list[str]) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rltrain.runtime.call_worker", str(to_child_r), str(from_child_w), str(os.getpid())],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a kill reaches what the function started
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.outbox = Connection(to_child_w, readable=False)
        self.inbox = Connection(from_child_r, writable=False)
        send(self.outbox, [list(sys.path), paths])
        self.started = time.monotonic()
        self.ready = False
        self.task: int | None = None  # index of the call it runs
        self.task_started = 0.0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.inbox.close()
        self.outbox.close()

    def exit_description(self) -> str:
        try:
            code = self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            return "it closed its pipe"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


class CallPool:
    """`size` workers that have imported `paths`; `run` spreads calls over them, each bounded."""

    def __init__(self, size: int, paths: list[str], label: str) -> None:
        self.size, self.paths, self.label = size, paths, label
        self.workers: list[Worker] = []

    def start(self) -> None:
        """Start the missing workers (they import while the caller does other work)."""
        while len(self.workers) < self.size:
            self.workers.append(Worker(self.paths))

    def run(self, calls: list[Call], timeout_s: float | None, deadline: float | None = None) -> list[CallResult]:
        """Every call's result, in order. A call past `timeout_s` (None: no limit) costs its worker;
        at `deadline` (time.monotonic()) the calls still running or waiting fail as timeouts."""
        self.start()
        results: list[CallResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(w.task is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.task is None and pending:
                    w.task, w.task_started = pending.popleft(), time.monotonic()
                    try:
                        send(w.outbox, [calls[w.task].path, calls[w.task].kwargs])
                    except TypeError as exc:
                        raise UserError(f"the arguments of {calls[w.task].path} cannot be sent to its worker: {exc}") from None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._expire_all(results, pending, "the step's time for them ran out")
                break
            ready = wait([w.inbox for w in self.workers], timeout=self._next_wakeup(now, timeout_s, deadline))
            for w in [w for w in self.workers if w.inbox in ready]:
                self._receive(w, results)
            now = time.monotonic()
            for w in list(self.workers):
                if w.task is not None and timeout_s and now - w.task_started > timeout_s:
                    results[w.task] = CallResult(failure="timeout", message=f"no result within {timeout_s:g} s")
                    self._replace(w)
                elif not w.ready and now - w.started > STARTUP_S:
                    self._replace(w)
                    raise UserError(f"a {self.label} worker did not start within {STARTUP_S:g} s (importing {self.paths}).")
        return [r if r is not None else CallResult(failure="timeout", message="not run") for r in results]

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def _next_wakeup(self, now: float, timeout_s: float | None, deadline: float | None) -> float:
        times = [w.started + STARTUP_S for w in self.workers if not w.ready]
        if timeout_s:
            times += [w.task_started + timeout_s for w in self.workers if w.task is not None]
        if deadline is not None:
            times.append(deadline)
        return max(0.0, min(times) - now + 0.001) if times else 1.0

    def _receive(self, w: Worker, results: list[CallResult | None]) -> None:
        try:
            kind, payload = receive(w.inbox)
        except (EOFError, OSError):
            died = f"ended its worker process ({w.exit_description()})"
            if w.task is not None:
                results[w.task] = CallResult(failure="died", message=died)
                self._replace(w)
                return
            self._replace(w)
            raise UserError(f"a {self.label} worker ended before it was ready: {self.paths} {died}.") from None
        if kind == "ready":
            w.ready = True
        elif kind == "load_error":
            self._replace(w)
            raise UserError(payload)
        elif w.task is not None:
            results[w.task] = CallResult(value=payload) if kind == "ok" else CallResult(failure="error", message=payload)
            w.task = None

    def _replace(self, w: Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = Worker(self.paths)

    def _expire_all(self, results: list[CallResult | None], pending: deque, why: str) -> None:
        for w in list(self.workers):
            if w.task is not None:
                results[w.task] = CallResult(failure="timeout", message=why)
                self._replace(w)
        while pending:
            results[pending.popleft()] = CallResult(failure="timeout", message=why)
