"""trackio: its local database (`TRACKIO_DIR`, by default under the Hugging Face cache; `trackio show`
opens its dashboard), or a Hugging Face Space with `logger.trackio.space_id`.

The project is the W&B project and the run's group the W&B group, so a sweep's jobs are grouped as
W&B groups them; the run is named as the W&B run, and a resumed run continues it (trackio's
`resume="allow"` by name). The composed config is the run's config; samples are trackio tables, the
plot an image. trackio's own start-up lines are replaced by one line at the end. docs/trackers.md.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from rltrain.config.schema import Config
from rltrain.run.samples import TABLE_COLUMNS, Sample
from rltrain.run.trackers.run_config import config_dict


class TrackioTracker:
    def __init__(self, run: Any, project: str) -> None:
        self.run = run
        self.project = project

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, key: str, step: int, samples: list[Sample]) -> None:
        import trackio

        rows = [[step, s.prompt, s.completion, s.reward] for s in samples]
        self.run.log({key: trackio.Table(columns=list(TABLE_COLUMNS), data=rows)}, step=step)

    def log_image(self, key: str, step: int, path: Path) -> None:
        import trackio

        self.run.log({key: trackio.Image(str(path))}, step=step)

    def close(self) -> None:
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):
            trackio.finish()  # this run, the current one; trackio's exit hook then has none left to finish again
        print(f"rltrain: trackio run saved in {trackio.TRACKIO_DIR} (project {self.project}); "
              f"view it with `trackio show --project {self.project}`", flush=True)


def open_trackio(cfg: Config, run_dir: Path, resume_step: int) -> TrackioTracker:
    import trackio

    project = cfg.logger.wandb.project
    with contextlib.redirect_stdout(io.StringIO()):  # trackio's start-up lines; close() says where the run is
        run = trackio.init(
            project=project,
            name=cfg.logger.wandb.name or run_dir.name,
            group=cfg.logger.wandb.group,
            space_id=cfg.logger.trackio.space_id,
            config=config_dict(cfg),
            resume="allow",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )
    return TrackioTracker(run, project)
