"""TensorBoard: event files under `RUN_DIR/tensorboard/`, written offline, read by `tensorboard --logdir`.

A sweep's jobs sit in one sweep directory, so `tensorboard --logdir multirun/<date>/<time>` shows them
as one group, as W&B groups them. The composed config is the run's hparams and a `config` text;
samples are markdown text, the run's plot an image. On resume the events after the checkpoint's step
are purged (they are produced again), as metrics.jsonl is cut back. docs/trackers.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rltrain.config.schema import Config
from rltrain.run.samples import TABLE_COLUMNS, Sample
from rltrain.run.trackers.run_config import flat_config

TENSORBOARD_DIR = "tensorboard"


def samples_markdown(samples: list[Sample], step: int) -> str:
    """A markdown table (TensorBoard's text plugin renders it); `|` and newlines escaped per cell."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    rows = [[step, s.prompt, s.completion, s.reward] for s in samples]
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + " --- |" * len(TABLE_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class TensorBoardTracker:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, key: str, step: int, samples: list[Sample]) -> None:
        self.writer.add_text(key, samples_markdown(samples, step), step)

    def log_image(self, key: str, step: int, path: Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        self.writer.add_image(key, pixels, step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(cfg: Config, run_dir: Path, resume_step: int) -> TensorBoardTracker:
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None)
    if not resume_step:  # the resumed run's files already hold them
        writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(cfg, resolve=True) + "```", 0)
        events = writer.file_writer
        assert events is not None  # SummaryWriter opens its file writer on construction
        for summary in hparams(flat_config(cfg), {}):
            events.add_summary(summary)
        writer.flush()
    return TensorBoardTracker(writer)
