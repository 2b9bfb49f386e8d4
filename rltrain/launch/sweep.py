"""`sweep_summary.csv`: one row per job of a Hydra multirun, written by a Hydra callback.

A sweep should end with one table of how every job went, and a sweeper such as Optuna should see
a failed job as a failed trial, not a crash: each job returns a `JobOutcome` and `SweepSummary`
gathers their rows wherever the jobs ran (here or under submitit). Rows, columns and the
objective: docs/internals/launch.md.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from rltrain.config.schema import SweepDirection

SUMMARY_FILE = "sweep_summary.csv"
ROW_FILE = "sweep_row.json"
DIRECTIONS: tuple[str, ...] = get_args(SweepDirection)  # sweep.direction, as Optuna names them
METRIC_COLUMNS = ("loss", "reward/mean", "eval/accuracy", "eval/reward")
COLUMNS = ("job", "status", "exit_status", "overrides", "objective", *METRIC_COLUMNS, "error", "run_dir")

# The first failed job's exit status of the last sweep this process ran (0: none failed).
_exit_status = {"last": 0}


@dataclass
class JobOutcome:
    """How one job of a sweep ended; `float()` of it is the job's objective, for the sweeper."""

    status: str  # ok | failed
    exit_status: int
    error: str = ""
    objective: float | None = None  # None: the job failed, or never logged a finite objective
    objective_key: str = ""

    def __float__(self) -> float:
        if self.objective is None:
            why = self.error if self.status != "ok" else f"it logged no finite {self.objective_key!r}"
            raise ValueError(f"no objective: the job {'failed' if self.status != 'ok' else 'ran, but'} ({why})")
        return self.objective


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a job's metrics.jsonl (a torn last line of a killed job is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def final_metrics(run_dir: Path, keys: tuple[str, ...] = METRIC_COLUMNS) -> dict[str, Any]:
    """The last logged value of each key in the job's metrics.jsonl (missing keys are left out)."""
    out: dict[str, Any] = {}
    for r in metric_rows(run_dir):
        out.update({key: r[key] for key in keys if key in r})
    return out


def objective_value(run_dir: Path, key: str, last_n: int) -> float | None:
    """The mean of the last `last_n` finite values of `key` in metrics.jsonl; None when there are
    none (a non-finite value is logged as null, in older files as a string such as "nan": neither counts)."""
    values = [float(r[key]) for r in metric_rows(run_dir) if isinstance(r.get(key), (int, float))]
    values = [v for v in values if math.isfinite(v)][-last_n:]
    return sum(values) / len(values) if values else None


def row(job_num: int, overrides: list[str], run_dir: Path, outcome: JobOutcome) -> dict[str, Any]:
    r: dict[str, Any] = {column: "" for column in COLUMNS}
    r.update(
        job=job_num,
        status=outcome.status,
        exit_status=outcome.exit_status,
        overrides=" ".join(overrides),
        objective="" if outcome.objective is None else outcome.objective,
        error=outcome.error,
        run_dir=str(run_dir),
    )
    r.update(final_metrics(run_dir))
    return r


def outcome_of(job_return: JobReturn) -> JobOutcome:
    """A job's outcome: what `sweep_job` returned, or the exception Hydra caught."""
    if job_return.status == JobStatus.COMPLETED:
        value = job_return.return_value
        return value if isinstance(value, JobOutcome) else JobOutcome("ok", 0)
    exc = job_return._return_value
    text = f"{type(exc).__name__}: {exc}".strip()
    return JobOutcome("failed", 1, text.splitlines()[0] if text else "")


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]]) -> Path:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / SUMMARY_FILE
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(COLUMNS))
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _cell(r.get(k, "")) for k in COLUMNS})
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(buf.getvalue())
    tmp.replace(path)
    return path


def _cell(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def format_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS, width: int = 80) -> str:
    """The rows as an aligned text table: columns empty in every row are left out, the overrides
    shown are the ones that differ between jobs, and long cells are cut at `width` characters."""
    shown = [c for c in columns if any(str(_cell(r.get(c, ""))) != "" for r in rows) or c in ("job", "status")]
    rows = [dict(r, overrides=o) for r, o in zip(rows, varying_overrides([str(r.get("overrides", "")) for r in rows]))]

    def cut(text: str) -> str:
        return text if len(text) <= width else text[: width - 3] + "..."

    cells = [[cut(str(_cell(r.get(c, "")))) for c in shown] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(shown)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(shown, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def varying_overrides(overrides: list[str]) -> list[str]:
    """Each job's overrides without those every job shares (the swept values); space-separated."""
    split = [o.split() for o in overrides]
    common = set.intersection(*(set(s) for s in split)) if len(split) > 1 else set()
    return [" ".join(o for o in s if o not in common) for s in split]


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def gather_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's row under the sweep directory, in job order."""
    rows = [json.loads(p.read_text()) for p in sweep_dir.rglob(ROW_FILE)]
    return sorted(rows, key=lambda r: int(r["job"]))


def _first_rank() -> bool:
    """False in every rank of a multi-rank job but the first (torchrun's RANK, or the task of a
    submitit job with several tasks), so one row per job is written."""
    if os.environ.get("RANK", "0") != "0":
        return False
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return True
    import submitit

    return submitit.JobEnvironment().global_rank == 0


def sweep_exit_status() -> int:
    """The first failed job's exit status of the last sweep this process ran; 0 when none failed."""
    return _exit_status["last"]


class SweepSummary(Callback):
    """Writes each job's row next to the job, and `sweep_summary.csv` at the end of the sweep."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_status["last"] = 0
        # Rows of an earlier sweep into the same directory would be summarised with this one's.
        for stale in Path(config.hydra.sweep.dir).resolve().rglob(ROW_FILE):
            stale.unlink()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        from hydra.types import RunMode

        hydra_cfg = config.get("hydra")
        if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN or not _first_rank():
            return
        run_dir = Path(hydra_cfg.runtime.output_dir)
        outcome = outcome_of(job_return)
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / ROW_FILE, row(int(hydra_cfg.job.num), list(job_return.overrides or []), run_dir, outcome))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        rows = gather_rows(sweep_dir)
        path = write_summary(sweep_dir, rows)
        failed = [r for r in rows if r["status"] != "ok"]
        _exit_status["last"] = int(failed[0]["exit_status"]) if failed else 0
        objective = f"; objective: {config.sweep.objective} ({config.sweep.direction})" if "sweep" in config else ""
        print(
            f"\nrltrain: sweep summary ({len(rows)} jobs, {len(failed)} failed{objective}) -> {path}\n{format_table(rows)}",
            flush=True,
        )
