"""Fixed opponents for `env=textarena` tests (env.opponent=ecosystem_opponents:NAME, with tests/ on
PYTHONPATH): one that fails in each way user code can, call by call."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from rltrain.envs.textarena.opponents import first_listed_move

COUNTER_ENV = "ECOSYSTEM_OPPONENT_CALLS"  # a file counting the calls, across the workers that replace a killed one


def _next_call() -> int:
    path = Path(os.environ[COUNTER_ENV])
    with path.open("a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = len(f.read())
        f.write(".")
    return n


def faulty(observation: str, transcript: list[dict[str, str]]):
    """Call 0 raises, call 1 hangs, call 2 returns garbage (not a move), every later call plays."""
    n = _next_call()
    if n == 0:
        raise RuntimeError("the opponent crashed")
    if n == 1:
        time.sleep(3600)
    if n == 2:
        return {"not": "a move"}
    return first_listed_move(observation, transcript)
