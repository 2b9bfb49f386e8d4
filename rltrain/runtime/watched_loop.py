"""The event loops of a call worker (rltrain/runtime/call_worker.py), one per call, watched.

Each call that returns an awaitable has it awaited on an event loop of its own, in the call's own
thread: a call that blocks its loop (a synchronous sleep, a CPU-bound stretch inside an `async def`)
stalls only itself, so a step with many such calls loses those and nothing else. One watchdog
thread per worker queues a beat on every live loop each tick; a loop whose beat has not run while
the same task stayed current for `BLOCKED_S` is blocked by that call, reported once to `report`.
The report only names the cause: should the call then run out of time, its failure says how to fix
it. It decides nothing, because hundreds of loops in one process contend for the interpreter lock
and a busy one can miss a beat that long without blocking anything (docs/agents.md, "Isolation").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

BLOCKED_S = 2.0  # a task that holds its loop this long without yielding has blocked it
TICK_S = 0.5  # each live loop is woken this often by its beat


@dataclass
class _Watched:
    loop: asyncio.AbstractEventLoop
    index: int  # the call it runs
    beats: int = 0
    queued: int = -1  # the beat count when a beat was last queued
    seen: tuple[int, Any] = (-1, None)  # (beats, current task) at the last tick that changed
    since: float = 0.0
    reported: bool = False

    def beat(self) -> None:
        self.beats += 1


class WatchedLoops:
    """Runs each awaitable on a fresh event loop in the caller's thread; a watchdog names the calls
    whose loop is blocked."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self.report = report
        self.live: dict[int, _Watched] = {}  # by thread id
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="calls-event-loop-watchdog", daemon=True).start()

    def run(self, index: int, awaitable: Awaitable[Any]) -> Any:
        """Await `awaitable` to its end on a loop of its own, then close the loop as asyncio.run
        does, except that threads the call left in the loop's executor are not waited for (its
        result is ready: it goes back now)."""

        async def awaited() -> Any:
            return await awaitable

        loop = asyncio.new_event_loop()
        with self.lock:
            self.live[threading.get_ident()] = _Watched(loop, index, since=time.monotonic())
        try:
            return loop.run_until_complete(awaited())
        finally:
            with self.lock:
                del self.live[threading.get_ident()]
            try:
                left = asyncio.all_tasks(loop)
                for task in left:
                    task.cancel()
                if left:
                    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()  # its executor shut down without waiting

    def _watch(self) -> None:
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            with self.lock:
                watched = list(self.live.values())
            for w in watched:
                self._check(w, now)

    def _check(self, w: _Watched, now: float) -> None:
        if w.queued != w.beats:
            w.queued = w.beats
            try:
                w.loop.call_soon_threadsafe(w.beat)
            except RuntimeError:  # closed since the copy of `live` was taken
                return
        task = asyncio.current_task(w.loop)
        if (w.beats, task) != w.seen or task is None:
            w.seen, w.since = (w.beats, task), now
            return
        if now - w.since >= BLOCKED_S and not w.reported:
            w.reported = True
            self.report(w.index)
