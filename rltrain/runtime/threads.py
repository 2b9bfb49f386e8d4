"""How many torch threads the trainer and a separate rollout engine take on a rank's cores.

A synchronous run gives the trainer every core of its rank and the engine the same count (they
never run at once). Generating ahead (`placement.max_staleness` >= 1) they run at the same time, so
unset counts split the rank's cores between them instead of oversubscribing (docs/async.md).
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (a container's cpuset, `taskset`), not the
    machine's count, so a limited process does not start more threads than it has cores."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_split(
    trainer_threads: int, engine_threads: int, overlapped: bool, world_size: int, cores: int | None = None
) -> tuple[int, int]:
    """(trainer threads, engine threads) per rank from `trainer.num_threads` and a separate engine's
    `rollout.num_threads` (0 = unset); `overlapped`: they run at once (`placement.max_staleness` >= 1)."""
    per_rank = max(1, (cores or usable_cores()) // world_size)
    if not overlapped:
        trainer = trainer_threads or per_rank
        return trainer, engine_threads or trainer
    if trainer_threads:
        trainer = trainer_threads
    else:
        trainer = max(1, per_rank - engine_threads) if engine_threads else max(1, per_rank // 2)
    return trainer, engine_threads or max(1, per_rank - trainer)
