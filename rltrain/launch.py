"""Local multi-rank launch (`trainer.nproc=N`): one worker process per rank, watched as a group.

Each worker is `python -m rltrain.worker RUN_DIR` with the env:// variables torchrun would set, and
reads the resolved `config.yaml` from the run directory (no pickled state crosses the process
boundary). If any rank exits non-zero or dies, the launcher gives the others a short grace period,
then terminates them, and reports which rank failed first: one lost rank never leaves the rest
hanging and never leaves the launcher waiting forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rltrain.distributed import _free_port

GRACE_S = 30.0


def spawn_local(run_dir: Path, nproc: int, grace_s: float = GRACE_S) -> int:
    """Run `nproc` ranks; return 0 if all succeed, else the first failing rank's exit code."""
    port = _free_port()
    procs: list[subprocess.Popen] = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "rltrain.worker", str(run_dir)], env=env))

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _watch(procs, grace_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _watch(procs: list[subprocess.Popen], grace_s: float) -> int:
    failed_rank: int | None = None
    failed_at = 0.0
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return 0
        if failed_rank is None:
            failed = [rank for rank, code in enumerate(codes) if code is not None and code != 0]
            if failed:
                # A rank killed by a signal is the cause; peers that exited with an error in the
                # same poll interval were its victims (their collectives failed).
                failed_rank, failed_at = min(failed, key=lambda r: (codes[r] >= 0, r)), time.monotonic()
                print(
                    f"rltrain: rank {failed_rank} exited with code {_describe(codes[failed_rank])}; stopping the other ranks",
                    file=sys.stderr,
                    flush=True,
                )
        if failed_rank is not None:
            if all(c is not None for c in codes) or time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                code = procs[failed_rank].returncode
                return code if code and code > 0 else 1
        time.sleep(0.2)


def _describe(code: int) -> str:
    if code < 0:
        return f"{code} (killed by {signal.Signals(-code).name})"
    return str(code)
