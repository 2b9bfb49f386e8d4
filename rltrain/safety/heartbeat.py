"""Per-rank heartbeats: a small JSON file per rank in the run directory, rewritten every second.

Why files: every rank already shares the run directory (torchrun ranks use rank 0's), reading them
needs no collective (so it still works while a collective hangs or after a peer died), and a human
can `cat` them. Each file holds the rank's pid and host (so a survivor on the same host can tell a
dead process from a slow one), the wall-clock time of the beat and the last step begun and finished.
A multi-node run needs the run directory on a shared filesystem for cross-node heartbeats.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

DIRNAME = "heartbeats"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / DIRNAME / f"rank-{rank}.json"


class Heartbeat:
    """Writes this rank's heartbeat from a daemon thread until `stop()`."""

    def __init__(self, run_dir: Path, rank: int, interval_s: float = 1.0) -> None:
        self.path = heartbeat_path(run_dir, rank)
        self.rank = rank
        self.interval_s = interval_s
        self.step = 0
        self.finished_step = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the beat thread and the training loop both write
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._run, name=f"rltrain-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def beat(self, step: int, finished: bool = False) -> None:
        if finished:
            self.finished_step = step
        else:
            self.step = step
        # At once, so a survivor reading it after a crash sees the step it died in; a full or
        # vanished disk must not stop training (the beat thread retries every interval).
        with contextlib.suppress(OSError):
            self.write()

    def write(self) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "step": self.step,
            "finished_step": self.finished_step,
        }
        with self._lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):  # a full or vanished disk: the beat just goes stale
                self.write()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def read_heartbeat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads(heartbeat_path(run_dir, rank).read_text())
    except (OSError, ValueError):
        return None


def process_gone(record: dict) -> bool:
    """True only when the rank ran on this host and its process no longer exists."""
    if record.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OSError, KeyError, ValueError):
        return False
    return False


def rank_status(run_dir: Path, rank: int, stale_after_s: float, now: float | None = None) -> tuple[bool, str]:
    """(alive, one-line description) of a rank from its heartbeat."""
    now = time.time() if now is None else now
    record = read_heartbeat(run_dir, rank)
    if record is None:
        return False, f"rank {rank}: no heartbeat"
    age = now - float(record["time"])
    where = f"step {record['step']}, last finished {record['finished_step']}"
    if process_gone(record):
        return False, f"rank {rank}: process {record['pid']} is gone (last heartbeat {age:.1f} s ago, {where})"
    if age > stale_after_s:
        return False, f"rank {rank}: heartbeat {age:.1f} s old (> {stale_after_s:g} s, {where})"
    return True, f"rank {rank}: alive ({where}, heartbeat {age:.1f} s ago)"


def describe_lost_peers(run_dir: Path, world_size: int, rank: int, stale_after_s: float = 5.0) -> str:
    """A sentence naming the peers that look lost (dead or silent), for a survivor's error message."""
    lost, alive = [], []
    for peer in range(world_size):
        if peer == rank:
            continue
        ok, text = rank_status(run_dir, peer, stale_after_s)
        (alive if ok else lost).append(text)
    if lost:
        return "lost " + "; ".join(lost)
    return "no peer looks dead (" + "; ".join(alive) + "): a peer may be stuck outside the collective"
