"""Where metrics go: `metrics.jsonl` (one JSON object per optimizer step, plus eval rows), the
trackers `logger.backends` names (W&B by default; rltrain.run.trackers), and the console (a progress bar on a terminal, plain periodic lines otherwise). Only rank 0 writes.

On resume the rows after the checkpoint's step are dropped from `metrics.jsonl` (they belong to
the run that was stopped and will be produced again), so the file ends with exactly one row per
step. A non-finite value is written `null`, never as a string. Every tracker receives exactly the numbers
written to the file (a null left out), plus the sample tables (`samples/train`, `samples/eval`:
rltrain.run.samples) and, when the run ends, its `plots.png` (docs/trackers.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rltrain.config.schema import Config
from rltrain.run.samples import Sample
from rltrain.run.trackers import Tracker, open_trackers


def finite_or_null(value: Any) -> Any:
    """A non-finite float (a skipped step's `grad_norm`) as None, written `null`: `NaN` and
    `Infinity` are not JSON that strict readers accept, and a string would mix text into a column of
    numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only rows with step <= last_step (atomic rewrite)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        if line.strip() and json.loads(line).get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


BATCHES_FILE = "batches.jsonl"  # an RL run's prompts per step and the policy version that sampled them


def append_batch_record(run_dir: Path, step: int, prompts: list[int], sampled_by: int) -> None:
    """One line of `batches.jsonl` (rank 0): which training prompts (indices into the prompt data)
    step `step` trained on, sampled by which policy version (docs/async.md). Truncated on resume
    with the metrics, so it lists every trained prompt exactly once per step."""
    with (run_dir / BATCHES_FILE).open("a") as f:
        f.write(json.dumps({"step": step, "prompts": prompts, "sampled_by": sampled_by}) + "\n")


class MetricsLogger:
    def __init__(self, cfg: Config, run_dir: Path, is_main: bool, resume_step: int) -> None:
        self.is_main = is_main
        self.path = run_dir / "metrics.jsonl"
        self.max_steps = cfg.trainer.max_steps
        self.log_every = max(1, cfg.trainer.log_every)
        self.trackers: list[Tracker] = []
        self.bar = None
        self.start_time = time.monotonic()
        if not is_main:
            return
        truncate_metrics(self.path, resume_step)
        truncate_metrics(run_dir / BATCHES_FILE, resume_step)
        self.file = self.path.open("a")
        self.trackers = open_trackers(cfg, run_dir, resume_step)
        mode = cfg.trainer.progress
        if mode == "bar" or (mode == "auto" and sys.stderr.isatty()):
            from tqdm import tqdm

            self.bar = tqdm(total=self.max_steps, initial=resume_step, desc="train", dynamic_ncols=True)

    def log(self, row: dict[str, Any]) -> None:
        if not self.is_main:
            return
        row = {k: finite_or_null(v) for k, v in row.items()}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        # a null is a value a tracker has no point for; anything but a number stays in the file alone
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(numbers, int(row["step"]))
        self._console(row)

    def log_samples(self, key: str, step: int, samples: list[Sample]) -> None:
        """A table of samples (rltrain.run.samples) under `key` at `step`, in every tracker."""
        if samples:
            for tracker in self.trackers:
                tracker.log_samples(key, step, samples)

    def log_image(self, key: str, step: int, path: Path) -> None:
        """A PNG (the run's `plots.png`) under `key` at `step`, in every tracker."""
        if self.is_main:
            for tracker in self.trackers:
                tracker.log_image(key, step, path)

    def _console(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        is_eval = any(k.startswith("eval/") for k in row)
        if self.bar is not None:
            if is_eval:
                self.bar.write(_format(row, self.max_steps))
            else:
                self.bar.n = step
                loss, tokens_per_s = row.get("loss"), row.get("tokens_per_s")
                self.bar.set_postfix(
                    loss=f"{loss:.4f}" if isinstance(loss, (int, float)) else "nan",
                    tok_s=f"{tokens_per_s:.0f}" if isinstance(tokens_per_s, (int, float)) else "0",
                    refresh=False,
                )
                self.bar.refresh()
            return
        if is_eval or step % self.log_every == 0 or step == self.max_steps or step == 1:
            print(_format(row, self.max_steps), flush=True)

    def close(self) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        for tracker in self.trackers:
            tracker.close()


def _format(row: dict[str, Any], max_steps: int) -> str:
    """One console line; the step is shown out of `max_steps`, so a reader of plain lines (no bar)
    knows how far the run has come."""
    keys = ["loss", "eval/accuracy", "eval/dpo_accuracy", "reward/mean", "grad_norm", "lr", "tokens_per_s"]
    parts = [f"step {int(row['step'])}/{max_steps}"]
    for key in keys + sorted(k for k in row if k.startswith("eval/") and k not in keys):
        if key in row and isinstance(row[key], (int, float)):
            parts.append(f"{key} {row[key]:.4g}")
    return " | ".join(dict.fromkeys(parts))
