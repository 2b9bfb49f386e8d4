"""Experiment trackers beside `metrics.jsonl`: W&B, TensorBoard, MLflow, trackio (`logger.backends`).

Every tracker implements `Tracker` (rltrain.run.trackers.tracker) in a module of its own; `TRACKERS`
names them, with the library each needs and the pip requirement that installs it (the preflight's
check, rltrain.preflight.trackers). docs/trackers.md says what each writes where.
"""

from __future__ import annotations

from pathlib import Path

from rltrain.config.schema import Config
from rltrain.run.trackers.mlflow_tracker import open_mlflow
from rltrain.run.trackers.tensorboard_tracker import open_tensorboard
from rltrain.run.trackers.tracker import Tracker, TrackerSpec
from rltrain.run.trackers.trackio_tracker import open_trackio
from rltrain.run.trackers.wandb_tracker import open_wandb

TRACKERS: dict[str, TrackerSpec] = {
    spec.name: spec
    for spec in (
        TrackerSpec("wandb", "wandb", "wandb==0.31.0", open_wandb),
        TrackerSpec("tensorboard", "tensorboard", "tensorboard==2.21.0", open_tensorboard),
        TrackerSpec("mlflow", "mlflow", "mlflow-skinny==3.17.2", open_mlflow),
        TrackerSpec("trackio", "trackio", "trackio==0.43.0", open_trackio),
    )
}


def open_trackers(cfg: Config, run_dir: Path, resume_step: int) -> list[Tracker]:
    """The trackers `logger.backends` names, opened in its order (rank 0 only)."""
    opened = (TRACKERS[name].open(cfg, run_dir, resume_step) for name in cfg.logger.backends)
    return [tracker for tracker in opened if tracker is not None]


__all__ = ["TRACKERS", "Tracker", "TrackerSpec", "open_trackers"]
