"""Entry point of one rank started by `rltrain.launch`: read the run's config.yaml and train.

`python -m rltrain.worker RUN_DIR LAUNCHER_PID`: the rank first asks the kernel to SIGKILL it when
the launcher dies (Linux `PR_SET_PDEATHSIG`), and exits at once if the launcher is already gone,
so that no rank outlives a launcher that was itself killed (SIGKILL cannot be forwarded); its
checkpoints stay in the run directory for a resume.

A `UserError` is recorded in the run directory (rltrain.errors) and the rank exits 2 without
printing: the launcher prints the first rank's paragraph once. A rank that failed because a peer
reported a user error first exits 1 without a traceback.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rltrain.errors import EXIT_USER_ERROR, UserError, ensure_reported, peer_reported, stay_quiet_after_peer

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def load_run_config(run_dir: Path):
    from rltrain.config import Config

    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))


def die_with_launcher(launcher_pid: int) -> None:
    """SIGKILL this process when its parent (the launcher) dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher_pid:  # the launcher died before the request took effect
        sys.exit(1)


def main(argv: list[str]) -> int:
    run_dir, launcher_pid = Path(argv[1]), int(argv[2])
    die_with_launcher(launcher_pid)
    rank = int(os.environ.get("RANK", "0"))
    cfg = load_run_config(run_dir)
    from rltrain.trainer import run

    try:
        run(cfg, run_dir)
    except UserError as exc:
        ensure_reported(run_dir, rank, str(exc))
        return EXIT_USER_ERROR
    except Exception:
        if peer_reported(run_dir, rank):
            stay_quiet_after_peer(run_dir, rank)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
