"""The rollout engine driven from a thread of its own, so generation overlaps the trainer's step.

One worker thread runs the engine's calls (generations, weight loads) strictly in submission order:
a weight load submitted after a generation waits for it, so which policy version samples which
batch is fixed by the order of submissions, never by timing (docs/async.md). Every call is bounded
by the engine's own timeout (`rollout.timeout_s` in the child process engine); a failed call
fails its future, and every later one, so the trainer sees the first error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")
_STOP = object()


class RolloutWorker:
    """A FIFO of engine calls run by one daemon thread; `pop_idle_s` is how long it waited for work."""

    def __init__(self, name: str = "rltrain-rollout") -> None:
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._idle_s = 0.0
        self._idle_since: float | None = time.perf_counter()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        if not self._thread.is_alive():
            future.set_exception(RuntimeError("the rollout worker is closed"))
            return future
        self._jobs.put((future, fn, args))
        return future

    def wait(self, future: Future[T], what: str, timeout_s: float) -> T:
        """`future`'s result; the engine's own timeout bounds each call, this is the backstop."""
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            raise RuntimeError(
                f"the rollout engine did not deliver {what} within {timeout_s:g} s (its calls are bounded by "
                "rollout.timeout_s each); the engine is stuck or far behind the trainer"
            ) from None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            with self._lock:
                if self._idle_since is not None:
                    self._idle_s += time.perf_counter() - self._idle_since
                    self._idle_since = None
            if job is _STOP:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                if self._failure is not None:  # an engine that failed once is not trusted again
                    future.set_exception(RuntimeError(f"an earlier rollout call failed: {self._failure}"))
                else:
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # handed to the trainer through the future
                        self._failure = exc
                        future.set_exception(exc)
            with self._lock:
                if self._jobs.empty():
                    self._idle_since = time.perf_counter()

    def pop_idle_s(self) -> float:
        """Seconds the engine waited for work since the last call (`time/wait_train`)."""
        with self._lock:
            now = time.perf_counter()
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            self._idle_s = 0.0
            if self._idle_since is not None:
                self._idle_since = now
            return idle

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel what has not started and stop the thread; a call in progress is bounded by its
        engine's timeout, and the engine's own close ends it sooner."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job[0].cancel()
        self._jobs.put(_STOP)
        self._thread.join(timeout=timeout_s)
