"""`sweep_summary.csv`: one row per job of a Hydra multirun, written by a Hydra callback.

Registered in conf/config.yaml under `hydra.callbacks.sweep_summary`. Each job of a sweep returns
its outcome (`rltrain.__main__.sweep_job`: status, exit status, first error line); `on_job_end`
turns it into a row, adding the job's final metrics from its `metrics.jsonl` where present; at the
end of the sweep `on_multirun_end` writes `<sweep dir>/sweep_summary.csv` (atomically) and prints
the same rows as a table.

Columns, in order: `job, status, exit_status, overrides, <METRIC_COLUMNS...>, error, run_dir`.
A metric column holds the last logged value of that key (empty when the job logged none). To add
a column, add the key to METRIC_COLUMNS (or a field to `row()`): nothing else depends on the order.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

SUMMARY_FILE = "sweep_summary.csv"
METRIC_COLUMNS = ("loss", "reward/mean", "eval/accuracy", "eval/reward")
COLUMNS = ("job", "status", "exit_status", "overrides", *METRIC_COLUMNS, "error", "run_dir")


def final_metrics(run_dir: Path, keys: tuple[str, ...] = METRIC_COLUMNS) -> dict[str, Any]:
    """The last logged value of each key in the job's metrics.jsonl (missing keys are left out)."""
    out: dict[str, Any] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed job
        for key in keys:
            if key in row:
                out[key] = row[key]
    return out


def row(job_num: int, overrides: list[str], run_dir: Path, outcome: dict[str, Any]) -> dict[str, Any]:
    r = {column: "" for column in COLUMNS}
    r.update(
        job=job_num,
        status=outcome.get("status", "failed"),
        exit_status=outcome.get("exit_status", 1),
        overrides=" ".join(overrides),
        error=outcome.get("error", ""),
        run_dir=str(run_dir),
    )
    r.update(final_metrics(run_dir))
    return r


def outcome_of(job_return: JobReturn) -> dict[str, Any]:
    """A job's outcome: what `sweep_job` returned, or the exception Hydra caught."""
    if job_return.status == JobStatus.COMPLETED:
        value = job_return.return_value
        if isinstance(value, dict) and "status" in value:
            return value
        return {"status": "ok", "exit_status": 0, "error": ""}
    exc = job_return._return_value
    text = f"{type(exc).__name__}: {exc}"
    return {"status": "failed", "exit_status": 1, "error": text.strip().splitlines()[0] if text.strip() else ""}


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
    rows = [dict(r, overrides=o) for r, o in zip(rows, _varying([str(r.get("overrides", "")) for r in rows]))]

    def cut(text: str) -> str:
        return text if len(text) <= width else text[: width - 3] + "..."

    cells = [[cut(str(_cell(r.get(c, "")))) for c in shown] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(shown)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(shown, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def _varying(overrides: list[str]) -> list[str]:
    """Each job's overrides without those every job shares (the swept values)."""
    split = [o.split() for o in overrides]
    common = set.intersection(*(set(s) for s in split)) if len(split) > 1 else set()
    return [" ".join(o for o in s if o not in common) for s in split]


class SweepSummary(Callback):
    """Collects one row per job and writes `sweep_summary.csv` at the end of the sweep."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.rows = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        from hydra.types import RunMode

        hydra_cfg = config.get("hydra")
        if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
            return
        self.rows.append(
            row(int(hydra_cfg.job.num), list(job_return.overrides or []), Path(hydra_cfg.runtime.output_dir), outcome_of(job_return))
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        rows = sorted(self.rows, key=lambda r: r["job"])
        path = write_summary(Path(config.hydra.sweep.dir).resolve(), rows)
        failed = sum(r["status"] != "ok" for r in rows)
        print(f"\nrltrain: sweep summary ({len(rows)} jobs, {failed} failed) -> {path}\n{format_table(rows)}", flush=True)
