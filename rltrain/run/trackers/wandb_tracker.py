"""W&B: online with an API key, offline (files under the run dir) without one (`logger.wandb.mode`).

A resumed run continues the same W&B run (its id is kept in `RUN_DIR/wandb_id.txt`); a sweep's jobs
share the W&B group `logger.wandb.group` (the sweep directory's name by default). docs/trackers.md.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

from rltrain.config.schema import Config
from rltrain.run.samples import TABLE_COLUMNS, Sample


class WandbTracker:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, key: str, step: int, samples: list[Sample]) -> None:
        import wandb

        table = wandb.Table(columns=list(TABLE_COLUMNS), data=[[step, s.prompt, s.completion, s.reward] for s in samples])
        self.run.log({key: table}, step=step)

    def log_image(self, key: str, step: int, path: Path) -> None:
        import wandb

        self.run.log({key: wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        offline_dir = self.run.settings.sync_dir if self.run.offline else None
        self.run.finish()
        if offline_dir is not None:  # W&B is silent (console="off"), so say where the run went
            print(f"rltrain: W&B run saved offline in {offline_dir}; upload it with `wandb sync {offline_dir}`", flush=True)


def open_wandb(cfg: Config, run_dir: Path, resume_step: int) -> WandbTracker | None:
    """None when `logger.wandb.mode=disabled`."""
    mode: Any = cfg.logger.wandb.mode  # wandb.init types its own values, not `auto`
    if mode == "disabled":
        return None
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    # vLLM imports openai, and W&B then advertises its Weave tracer at init ("Detected [openai] in
    # use ..."): nothing a training run can act on. W&B's own switch, unless the user set it.
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
    import wandb

    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
    id_file.write_text(run_id)
    run = wandb.init(
        project=cfg.logger.wandb.project,
        entity=cfg.logger.wandb.entity,
        group=cfg.logger.wandb.group,
        name=cfg.logger.wandb.name or run_dir.name,
        dir=str(run_dir),
        mode=mode,
        id=run_id,
        resume="allow",
        config=cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True)),  # a DictConfig: a dict
        settings=wandb.Settings(console="off", silent=True),
    )
    return WandbTracker(run)
