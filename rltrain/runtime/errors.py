"""Errors that are the user's to fix: printed as one paragraph, never as a bare traceback.

A `UserError` may be raised on any rank, yet must reach the user once, naming the rank, with exit
status 2, while the peers whose collectives fail stay quiet. So the failing rank records its
paragraph under `RUN_DIR/errors/` before it leaves its collectives. The files and who prints
them: docs/internals/runtime.md; what a user sees: docs/failure-behaviour.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad config, a missing file or column, an input the run cannot use. The message names the
    problem and the fix; the entry point prints it and exits with status 2."""


def require_extra(module: str, needed_by: str, pin: str, extra: str, otherwise: str) -> None:
    """An optional extra (pyproject) a run names but this environment lacks: one paragraph with the
    command that installs it, before anything is built, instead of an ImportError mid-run."""
    if importlib.util.find_spec(module) is None:
        raise UserError(
            f"{needed_by}, which is not installed in this environment ({module} cannot be imported). Install it with "
            f"`.venv/bin/python -m pip install '{pin}'` (the rltrain[{extra}] extra; `make install` installs it), or {otherwise}."
        )


def _errors_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "errors"


def format_error(message: str, rank: int | None = None) -> str:
    """The one line the user sees: `rltrain: error: [rank N: ]paragraph`."""
    where = f"rank {rank}: " if rank is not None else ""
    return f"rltrain: error: {where}{message}"


def clear_reports(run_dir: Path) -> None:
    """Forget the reports of an earlier attempt in this run directory (a resumed run)."""
    d = _errors_dir(run_dir)
    if d.is_dir():
        for f in d.iterdir():
            with contextlib.suppress(OSError):  # best effort: a report left behind is overwritten
                f.unlink()


def report_user_error(run_dir: Path, rank: int, message: str) -> bool:
    """Record this rank's paragraph; return whether this rank is the first to report (it owns
    the one message the user sees)."""
    d = _errors_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"rank{rank}.txt.tmp"
    tmp.write_text(message)
    tmp.replace(d / f"rank{rank}.txt")
    try:
        fd = os.open(d / "first", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(rank))
    return True


def ensure_reported(run_dir: Path, rank: int, message: str) -> bool:
    """`report_user_error` unless this rank already reported; whether this rank's report is the
    first (the one the user sees)."""
    if not (_errors_dir(run_dir) / f"rank{rank}.txt").exists():
        report_user_error(run_dir, rank, message)
    first = first_report(run_dir)
    return first is not None and first[0] == rank


def first_report(run_dir: Path) -> tuple[int, str] | None:
    """(rank, paragraph) of the first rank that reported a UserError in this run directory."""
    d = _errors_dir(run_dir)
    try:
        rank = int((d / "first").read_text().strip())
        return rank, (d / f"rank{rank}.txt").read_text()
    except (OSError, ValueError):
        return None


def report_lost_peer(run_dir: Path, rank: int) -> None:
    """Record that this rank fails because a collective failed: its exit is a consequence of a
    peer's, so the launcher names that peer when it failed too (best effort: without the record
    the launcher falls back to the lowest failed rank)."""
    d = _errors_dir(run_dir)
    with contextlib.suppress(OSError):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{rank}.lost_peer").touch()


def lost_peer_ranks(run_dir: Path) -> set[int]:
    """The ranks that recorded `report_lost_peer` in this run directory."""
    d = _errors_dir(run_dir)
    if not d.is_dir():
        return set()
    return {int(f.name.removeprefix("rank").removesuffix(".lost_peer")) for f in d.glob("rank*.lost_peer")}


def peer_reported(run_dir: Path, rank: int) -> bool:
    """Whether another rank reported a UserError first (this rank's failure is its consequence)."""
    first = first_report(run_dir)
    return first is not None and first[0] != rank


def stay_quiet_after_peer(run_dir: Path, rank: int) -> None:
    """Keep this rank's traceback (a consequence of a peer's error) out of the user's way."""
    d = _errors_dir(run_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{rank}.traceback").write_text(traceback.format_exc())
    except OSError:
        traceback.print_exc(file=sys.stderr)
