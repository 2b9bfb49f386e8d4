"""User functions called in worker processes that a deadline can stop, many calls at once.

User code may hang, run for minutes or crash the interpreter, and a thread cannot be killed. Up to
`concurrency` calls run at once: one per worker in its main thread (reward functions), or several
in threads (environment calls), each async one on an event loop of its own
(rltrain/runtime/watched_loop.py). A call past its deadline is given up on (it fails; its message
says so where it had blocked its event loop) and left in its thread: its worker takes no more calls
once a ready spare can take its place, and is killed once the calls beside it have ended. Calls on
a worker that died under them run again once, each alone. Workers are `python -m
rltrain.runtime.call_worker` processes; calls and results cross as JSON (docs/agents.md, "Isolation")."""

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
from rltrain.runtime.watched_loop import BLOCKED_S

STARTUP_S = 120.0  # a worker's interpreter start and imports (a loaded machine is slow)
STOP_S = 5.0
RERUNS = 1  # times a call runs again after its worker died under it


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
    """One worker process and the pipes to it (the parent's ends); `tasks` maps the index of each
    call it runs to when it was sent; `abandoned` holds the calls given up on that still hold a
    thread in it (while it does it must not outlive the run: such a call's late answer carries an
    index a later run reuses)."""

    def __init__(self, paths: list[str], slots: int, env: dict[str, str] | None = None) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rltrain.runtime.call_worker", str(to_child_r), str(from_child_w), str(os.getpid())],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a kill reaches what the function started
            env={**os.environ, **env} if env else None,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.outbox = Connection(to_child_w, readable=False)
        self.inbox = Connection(from_child_r, writable=False)
        send(self.outbox, [list(sys.path), paths, slots > 1])
        self.slots = slots
        self.started = time.monotonic()
        self.ready = False
        self.tasks: dict[int, float] = {}
        self.alone = False  # it runs a call that lost a worker before: nothing else beside it
        self.gone = False  # its pipe broke on a send: it died, and its end-of-file is on the way
        self.abandoned: set[int] = set()
        self.blocked: set[int] = set()  # calls its watchdog saw blocking their event loop

    def free(self) -> bool:
        return self.ready and len(self.tasks) + len(self.abandoned) < self.slots and not self.alone and not self.gone

    def abandon(self, index: int) -> None:
        del self.tasks[index]
        self.abandoned.add(index)
        self.blocked.discard(index)
        self.alone = False

    def timeout_message(self, index: int, timeout_s: float) -> str:
        if index not in self.blocked:
            return f"no result within {timeout_s:g} s"
        return (
            f"no result within {timeout_s:g} s: it blocked its event loop (for more than {BLOCKED_S:g} s without yielding: "
            "a synchronous call inside an async def; await it, or run it with asyncio.to_thread)"
        )

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
    """`size` workers that have imported `paths`; `run` spreads calls over them, up to
    `concurrency` at once (default: one per worker), each bounded."""

    def __init__(
        self, size: int, paths: list[str], label: str, concurrency: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.size, self.paths, self.label, self.env = size, paths, label, env  # env: added to the workers' environment
        self.concurrency = max(1, concurrency if concurrency is not None else size)
        self.slots = -(-self.concurrency // size)  # calls one worker runs at once
        self.workers: list[Worker] = []
        self.spare: list[Worker] = []  # one replacement, started once a call was given up on or a worker lost
        self.retired: list[Worker] = []  # workers with abandoned calls whose other calls still run: no new calls

    def start(self) -> None:
        """Start the missing workers (they import while the caller does other work)."""
        while len(self.workers) < self.size:
            self.workers.append(Worker(self.paths, self.slots, self.env))

    def run(self, calls: list[Call], timeout_s: float | None, deadline: float | None = None) -> list[CallResult]:
        """Every call's result, in order. A call past `timeout_s` (None: no limit) fails and is
        abandoned, costing nothing to the calls beside it; at `deadline` (time.monotonic()) the calls
        still running or waiting fail as timeouts."""
        self.start()
        results: list[CallResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        reruns = [0] * len(calls)
        while pending or any(w.tasks for w in self._running()):
            self._dispatch(calls, pending, reruns)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._expire_all(results, pending, "the step's time for them ran out")
                break
            watched = [*self._running(), *self.spare]
            ready = wait([w.inbox for w in watched], timeout=self._next_wakeup(now, timeout_s, deadline))
            for w in [w for w in watched if w.inbox in ready]:
                self._receive(w, results, pending, reruns)
            now = time.monotonic()
            for w in self._running():
                for i, started in list(w.tasks.items()):
                    if timeout_s and now - started >= timeout_s:
                        results[i] = CallResult(failure="timeout", message=w.timeout_message(i, timeout_s))
                        w.abandon(i)
                if not w.ready and now - w.started > STARTUP_S:
                    self._replace(w)
                    raise UserError(f"a {self.label} worker did not start within {STARTUP_S:g} s (importing {self.paths}).")
            self._retire()
        for w in [*self.retired, *[w for w in self.workers if w.abandoned]]:  # an abandoned call must not answer in a later run
            self._replace(w)
        return [r if r is not None else CallResult(failure="timeout", message="not run") for r in results]

    def close(self) -> None:
        for w in [*self.workers, *self.retired, *self.spare]:
            w.kill()
        self.workers, self.retired, self.spare = [], [], []

    def _running(self) -> list[Worker]:
        return [*self.workers, *self.retired]

    def _retire(self) -> None:
        """Workers that abandoned a call: killed once nothing else runs on them; before that, one
        takes no more calls once a ready spare takes its place (until then it does: a spare's start
        never stalls the step). Retired workers are killed when their last call ends."""
        for w in [w for w in self.retired if not w.tasks]:
            self.retired.remove(w)
            w.kill()
        for w in [w for w in self.workers if w.abandoned]:
            if not w.tasks:
                self._replace(w)
            elif self.spare and self.spare[0].ready:
                self.retired.append(w)
                self.workers[self.workers.index(w)] = self.spare.pop()
                self.spare.append(Worker(self.paths, self.slots, self.env))
            elif not self.spare:
                self.spare.append(Worker(self.paths, self.slots, self.env))

    def _dispatch(self, calls: list[Call], pending: deque, reruns: list[int]) -> None:
        """Hand waiting calls to workers with a free slot, up to `concurrency` in flight. A call that
        runs again (its worker was lost under it) runs alone on an idle worker: if it was the one that
        crashed the worker, it takes no other call with it this time."""
        in_flight = sum(len(w.tasks) for w in self._running())
        for w in self.workers:
            while pending and w.free() and in_flight < self.concurrency:
                if reruns[pending[0]] and (w.tasks or w.abandoned):
                    break
                i = pending.popleft()
                w.tasks[i] = time.monotonic()
                w.alone = reruns[i] > 0
                in_flight += 1
                try:
                    send(w.outbox, [i, calls[i].path, calls[i].kwargs])
                except TypeError as exc:
                    raise UserError(f"the arguments of {calls[i].path} cannot be sent to its worker: {exc}") from None
                except OSError:  # the worker died since the last wait: the call never reached it
                    del w.tasks[i]
                    pending.appendleft(i)
                    w.gone, w.alone = True, False
                    in_flight -= 1

    def _next_wakeup(self, now: float, timeout_s: float | None, deadline: float | None) -> float:
        times = [w.started + STARTUP_S for w in self._running() if not w.ready]
        if timeout_s:
            times += [started + timeout_s for w in self._running() for started in w.tasks.values()]
        if deadline is not None:
            times.append(deadline)
        return max(0.0, min(times) - now + 0.001) if times else 1.0

    def _receive(self, w: Worker, results: list[CallResult | None], pending: deque, reruns: list[int]) -> None:
        try:
            kind, index, payload = receive(w.inbox)
        except (EOFError, OSError):
            died = f"ended its worker process ({w.exit_description()})"
            if w in self.spare:
                self.spare.remove(w)
                w.kill()
                if not w.ready:
                    raise UserError(f"a {self.label} worker ended before it was ready: {self.paths} {died}.") from None
            elif len(w.tasks) == 1:  # the call that ended it
                results[next(iter(w.tasks))] = CallResult(failure="died", message=died)
                self._replace(w)
            elif w.tasks:  # which of them ended it is unknown: each runs again, once, alone
                self._lose(w, results, pending, reruns, f"a worker running it with others {died}")
            elif w.ready:  # it died idle (killed from outside, or between a call and the next)
                self._replace(w)
            else:
                self._replace(w)
                raise UserError(f"a {self.label} worker ended before it was ready: {self.paths} {died}.") from None
            return
        if kind == "ready":
            w.ready = True
        elif kind == "load_error":
            if w in self.spare:
                self.spare.remove(w)
                w.kill()
            else:
                self._replace(w)
            raise UserError(payload)
        elif kind == "blocked":  # the cause, should it run out of time
            if index in w.tasks:
                w.blocked.add(index)
        elif index in w.tasks:
            results[index] = CallResult(value=payload) if kind == "ok" else CallResult(failure="error", message=payload)
            del w.tasks[index]
            w.blocked.discard(index)
            w.alone = False
        else:  # an abandoned call ended after all: its thread is gone
            w.abandoned.discard(index)

    def _lose(self, w: Worker, results: list[CallResult | None], pending: deque, reruns: list[int], why: str) -> None:
        """`w` died under its calls, which one caused it unknown: each call without a result runs
        again alone on a fresh worker (first in line), and fails as "died" once it used its reruns."""
        again = []
        for i in w.tasks:
            if results[i] is not None:
                continue
            if reruns[i] < RERUNS:
                reruns[i] += 1
                again.append(i)
            else:
                results[i] = CallResult(failure="died", message=f"{why}, {RERUNS + 1} times")
        pending.extendleft(reversed(again))
        self._replace(w)

    def _replace(self, w: Worker) -> None:
        """Kill `w`; a spare worker, started at the first replacement and kept since (a pool that
        lost one worker tends to lose more: a hung or loop-blocking function), takes its place."""
        w.kill()
        if w in self.retired:
            self.retired.remove(w)
            return
        fresh = self.spare.pop() if self.spare else Worker(self.paths, self.slots, self.env)
        self.workers[self.workers.index(w)] = fresh
        self.spare.append(Worker(self.paths, self.slots, self.env))

    def _expire_all(self, results: list[CallResult | None], pending: deque, why: str) -> None:
        for w in self._running():
            if w.tasks or w.abandoned:
                for i in w.tasks:
                    results[i] = CallResult(failure="timeout", message=why)
                self._replace(w)
        while pending:
            results[pending.popleft()] = CallResult(failure="timeout", message=why)
