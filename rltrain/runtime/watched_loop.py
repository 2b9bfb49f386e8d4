"""The one event loop of a call worker (rltrain/runtime/call_worker.py), watched.

The async functions a worker runs share one loop (frameworks keep async clients bound to the loop
they were made in), so one that blocks it (a synchronous sleep, a CPU-bound stretch inside an
`async def`) stalls every other call on it. A watchdog thread sees the loop stuck in one task for
`BLOCKED_S` and names that task's call (`CALL_INDEX`, as the call's context had it when the task
was created) to `report`: the pool then fails that call as hung and runs the others again on a
fresh worker (docs/agents.md, "Isolation").
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

BLOCKED_S = 2.0  # a task that holds the loop this long without yielding has blocked it
TICK_S = 0.05
CALL_INDEX: contextvars.ContextVar[int | None] = contextvars.ContextVar("rltrain_call_index", default=None)


class WatchedLoop:
    """An event loop in a thread of its own for the worker's life, and its watchdog."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self.report = report
        self.loop = asyncio.new_event_loop()
        self.owners: weakref.WeakKeyDictionary[asyncio.Future[Any], int | None] = weakref.WeakKeyDictionary()
        self.loop.set_task_factory(self._task)
        self.beats = 0
        threading.Thread(target=self.loop.run_forever, name="calls-event-loop", daemon=True).start()
        threading.Thread(target=self._watch, name="calls-event-loop-watchdog", daemon=True).start()

    def run(self, awaitable: Awaitable[Any]) -> Any:
        """Await `awaitable` on the loop from a call's thread (the task inherits the call's context)."""

        async def wrapped() -> Any:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result()

    def _task(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        """Every task of the loop, with the call it belongs to (its creator's context)."""
        context = kwargs.get("context")
        task = asyncio.Task(coro, loop=loop, **kwargs)
        self.owners[task] = context.get(CALL_INDEX) if context is not None else CALL_INDEX.get()
        return task

    def _beat(self) -> None:
        self.beats += 1

    def _watch(self) -> None:
        """Each tick, a beat is queued on the loop; a loop whose beat has not run while the same task
        stayed current for BLOCKED_S is blocked by that task (reported once)."""
        seen: tuple[int, Any] = (-1, None)
        since = time.monotonic()
        reported: Any = None
        queued = -1
        while not self.loop.is_closed():
            if queued != self.beats:
                queued = self.beats
                self.loop.call_soon_threadsafe(self._beat)
            time.sleep(TICK_S)
            task = asyncio.current_task(self.loop)
            now = time.monotonic()
            if (self.beats, task) != seen or task is None:
                seen, since = (self.beats, task), now
                continue
            if now - since >= BLOCKED_S and task is not reported:
                reported = task
                index = self.owners.get(task)
                if index is not None:
                    self.report(index)
