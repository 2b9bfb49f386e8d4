"""Hang watchdog (`health.hang_timeout_s`): no completed step for that long is a bug, so say where.

A daemon thread on every rank watches the time since the last completed training step. When it
runs out, the rank writes every thread's Python stack (faulthandler, which works even while the
main thread is blocked inside a C++ collective) to `stacks/rank-<r>.txt` in the run directory and
exits with HANG_EXIT_CODE. It first drops a `stacks/REQUEST` file that the other ranks' watchdogs
also obey, and waits a moment before exiting, so that every rank's stack is on disk before the
first exit makes its peers' collectives fail.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

HANG_EXIT_CODE = 3
STACKS_DIRNAME = "stacks"


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float, poll_s: float = 0.5, grace_s: float = 3.0) -> None:
        self.dir = Path(run_dir) / STACKS_DIRNAME
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._last = time.monotonic()
        self._started_wall = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def request_file(self) -> Path:
        return self.dir / "REQUEST"

    def start(self) -> None:
        self._last = time.monotonic()
        self._started_wall = time.time()  # a REQUEST left by an earlier run in this directory is ignored
        self._thread = threading.Thread(target=self._run, name=f"rltrain-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        """A step completed."""
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self.fire(f"rank {self.rank}: no training step completed for {idle:.0f} s (health.hang_timeout_s={self.timeout_s:g})")
            elif self._fresh_request():
                self.fire(f"rank {self.rank}: stack dump requested by a peer's watchdog ({self.request_file.read_text().strip()})")

    def _fresh_request(self) -> bool:
        try:
            return self.request_file.stat().st_mtime >= self._started_wall - 1.0
        except OSError:
            return False

    def fire(self, reason: str) -> None:
        """Dump this process's stacks, ask the peers to do the same, exit non-zero."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self._fresh_request():
            self.request_file.write_text(reason + "\n")
        path = self.dir / f"rank-{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"# {reason}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"rltrain: hang watchdog: {reason}; Python stacks written to {path}", file=sys.stderr, flush=True)
        time.sleep(self.grace_s)  # let the peers' watchdogs see REQUEST and dump before collectives break
        os._exit(HANG_EXIT_CODE)
