"""The one interface every experiment tracker implements (W&B, TensorBoard, MLflow, trackio).

rltrain.run.metrics_log writes `metrics.jsonl` and hands each row to every tracker the run names in
`logger.backends`; a tracker turns the row, the sample tables and the run's plot into its own
records. Each tracker lives in a module of its own and imports its library only when a run opens it,
so naming the trackers (the preflight's install check, docs/trackers.md) costs no import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rltrain.config.schema import Config
    from rltrain.run.samples import Sample


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None:
        """One row's numbers (a null already left out), at optimizer step `step`."""

    def log_samples(self, key: str, step: int, samples: list[Sample]) -> None:
        """A table of (prompt, completion, reward) samples under `key` (rltrain.run.samples)."""

    def log_image(self, key: str, step: int, path: Path) -> None:
        """A PNG (the run's `plots.png`) under `key`."""

    def close(self) -> None:
        """Flush and finish; say where an offline run's files are when the user must act on them."""


@dataclass(frozen=True)
class TrackerSpec:
    """How a run opens one tracker, and what to install when its library is missing."""

    name: str  # as `logger.backends` names it
    module: str  # the library's import name, probed by the preflight without importing it
    install: str  # the pip requirement (the pyproject extra's pin)
    open: Callable[[Config, Path, int], Tracker | None]  # (config, run dir, resume step); None: switched off
