"""Per-rank heartbeats: a small JSON file per rank in the run directory, rewritten every second.

Files need no collective, so they can still be read while a collective hangs or after a peer died.
A beat only proves the process lives, so each file also records the rank's last progress, and
`rank_status` judges a rank by both. Why files, and the limits: docs/internals/safety.md.
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
FIRST_STEP_FACTOR = 3.0  # the progress limit before a rank's first completed step, in stale_after_s


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
        self.progress_time = time.time()  # the start of training counts as progress
        self.steps_done = 0  # steps completed by this process (0: the first-step allowance applies)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the beat thread and the training loop both write
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._run, name=f"rltrain-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        """Record progress that is not a step (e.g. the step-0 evaluation) and write at once."""
        self.progress_time = time.time()
        with contextlib.suppress(OSError):
            self.write()

    def beat(self, step: int, finished: bool = False) -> None:
        if finished:
            self.finished_step = step
            self.progress_time = time.time()
            self.steps_done += 1
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
            "progress_time": self.progress_time,
            "steps_done": self.steps_done,
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


def rank_status(
    run_dir: Path,
    rank: int,
    stale_after_s: float,
    now: float | None = None,
    judge_progress: bool = True,
    watched_since: float | None = None,
) -> tuple[bool, str]:
    """(alive, one-line description) of a rank from its heartbeat: dead when its process is gone or
    its beat is older than `stale_after_s`; stuck (with `judge_progress`) when it has made no
    progress for `stale_after_s` (`FIRST_STEP_FACTOR` times that before its first step). A rank
    that has not beaten yet is starting for `stale_after_s` after `watched_since` (the health
    server's start: its peers start their heartbeats a moment apart), dead after that."""
    now = time.time() if now is None else now
    record = read_heartbeat(run_dir, rank)
    if record is None:
        if watched_since is not None and now - watched_since <= stale_after_s:
            return True, f"rank {rank}: starting (no heartbeat yet, {now - watched_since:.1f} s after the health server started)"
        return False, f"rank {rank}: no heartbeat"
    age = now - float(record["time"])
    where = f"step {record['step']}, last finished {record['finished_step']}"
    if process_gone(record):
        return False, f"rank {rank}: process {record['pid']} is gone (last heartbeat {age:.1f} s ago, {where})"
    if age > stale_after_s:
        return False, f"rank {rank}: heartbeat {age:.1f} s old (> {stale_after_s:g} s, {where})"
    idle = now - float(record.get("progress_time", record["time"]))
    first = int(record.get("steps_done", 1)) == 0
    limit = stale_after_s * (FIRST_STEP_FACTOR if first else 1.0)
    if judge_progress and idle > limit:
        which = "its first step has not completed" if first else "no step completed"
        return False, (
            f"rank {rank}: stuck: {which} for {idle:.1f} s (> {limit:g} s, {where}); "
            f"its process is alive (heartbeat {age:.1f} s ago)"
        )
    return True, f"rank {rank}: alive ({where}, last progress {idle:.1f} s ago, heartbeat {age:.1f} s ago)"


def describe_lost_peers(run_dir: Path, world_size: int, rank: int, stale_after_s: float = 5.0) -> str:
    """A sentence naming the peers that look lost (dead or silent), for a survivor's error message."""
    lost: list[str] = []
    alive: list[str] = []
    for peer in range(world_size):
        if peer == rank:
            continue
        ok, text = rank_status(run_dir, peer, stale_after_s, judge_progress=False)  # waiting is not lost
        (alive if ok else lost).append(text)
    if lost:
        return "lost " + "; ".join(lost)
    return "no peer looks dead (" + "; ".join(alive) + "): a peer may be stuck outside the collective"
