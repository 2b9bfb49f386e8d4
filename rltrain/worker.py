"""Entry point of one rank started by `rltrain.launch.local`: read the run's config.yaml and train.

`python -m rltrain.worker RUN_DIR LAUNCHER_PID`: the rank first asks the kernel to SIGKILL it when
the launcher dies (rltrain.runtime.parent_death), and exits at once if the launcher is already gone.

A `UserError` is recorded in the run directory (rltrain.runtime.errors) and the rank exits 2 without
printing: the launcher prints the first rank's paragraph once. A rank that failed because a peer
reported a user error first exits 1 without a traceback; one whose collective failed records that,
so the launcher names the peer it lost, not this rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rltrain.runtime.errors import (
    EXIT_USER_ERROR,
    UserError,
    ensure_reported,
    peer_reported,
    report_lost_peer,
    stay_quiet_after_peer,
)
from rltrain.runtime.parent_death import die_with_parent


def load_run_config(run_dir: Path):
    from rltrain.config.schema import Config

    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))


def main(argv: list[str]) -> int:
    run_dir, launcher_pid = Path(argv[1]), int(argv[2])
    die_with_parent(launcher_pid)
    return train_rank(run_dir)


def train_rank(run_dir: str | Path) -> int:
    """This rank's part of the run in `run_dir`; the process's exit status."""
    run_dir = Path(run_dir)
    rank = int(os.environ.get("RANK", "0"))
    cfg = load_run_config(run_dir)
    from rltrain.run.trainer import run
    from rltrain.safety.error_kinds import is_collective_failure

    try:
        run(cfg, run_dir)
    except UserError as exc:
        ensure_reported(run_dir, rank, str(exc))
        return EXIT_USER_ERROR
    except Exception as exc:
        if peer_reported(run_dir, rank):
            stay_quiet_after_peer(run_dir, rank)
            return 1
        if is_collective_failure(exc):
            report_lost_peer(run_dir, rank)  # the launcher then names the peer that left first
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
