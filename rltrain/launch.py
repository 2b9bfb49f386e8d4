"""Local multi-rank launch (`trainer.nproc=N`): one worker process per rank, watched as a group.

Each worker is `python -m rltrain.worker RUN_DIR` with the env:// variables torchrun would set, and
reads the resolved `config.yaml` from the run directory (no pickled state crosses the process
boundary). If any rank exits non-zero or dies, the launcher gives the others a short grace period,
then terminates them, and reports which rank failed first: one lost rank never leaves the rest
hanging and never leaves the launcher waiting forever. A rank that raised a `UserError` recorded
its paragraph in the run directory (rltrain.errors): the launcher prints that paragraph once,
naming the rank, and exits 2, as a single-rank run would; the peers stopped by its departure stay
quiet.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rltrain.distributed import _free_port
from rltrain.errors import clear_reports, first_report, format_error

GRACE_S = 30.0
# After a rank's user error the cause is known: the peers get this long to leave by themselves.
USER_ERROR_GRACE_S = 10.0


@dataclass
class LaunchResult:
    code: int  # 0, or the first failing rank's exit code
    message: str = ""  # what was printed about the failure (its first line)


def spawn_local(run_dir: Path, nproc: int, grace_s: float = GRACE_S) -> int:
    """Run `nproc` ranks; return 0 if all succeed, else the first failing rank's exit code."""
    return run_local(run_dir, nproc, grace_s).code


def run_local(run_dir: Path, nproc: int, grace_s: float = GRACE_S) -> LaunchResult:
    """`spawn_local`, also returning what was reported about a failure."""
    clear_reports(run_dir)
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
        return _watch(procs, grace_s, Path(run_dir))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _watch(procs: list[subprocess.Popen], grace_s: float, run_dir: Path) -> LaunchResult:
    failed_rank: int | None = None
    failed_at = 0.0
    message = ""
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return LaunchResult(0)
        if failed_rank is None:
            failed = [rank for rank, code in enumerate(codes) if code is not None and code != 0]
            if failed:
                failed_at = time.monotonic()
                report = first_report(run_dir)
                if report is not None:
                    # A rank's user error: written before that rank left its collectives, so it
                    # is the cause even when a peer's exit was seen first.
                    failed_rank, paragraph = report
                    grace_s = min(grace_s, USER_ERROR_GRACE_S)
                    message = format_error(paragraph, failed_rank)
                else:
                    # A rank killed by a signal is the cause; peers that exited with an error in
                    # the same poll interval were its victims (their collectives failed).
                    failed_rank = min(failed, key=lambda r: (codes[r] >= 0, r))
                    message = f"rltrain: rank {failed_rank} exited with code {_describe(codes[failed_rank])}; stopping the other ranks"
                print(message, file=sys.stderr, flush=True)
        if failed_rank is not None:
            if all(c is not None for c in codes) or time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                code = procs[failed_rank].poll()
                return LaunchResult(code if code and code > 0 else 1, message.splitlines()[0])
        time.sleep(0.2)


def _describe(code: int) -> str:
    if code < 0:
        return f"{code} (killed by {signal.Signals(-code).name})"
    return str(code)
