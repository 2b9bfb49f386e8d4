"""MLflow: a local file store in `RUN_DIR/mlruns/` by default (offline; `mlflow ui --backend-store-uri
RUN_DIR/mlruns` shows it), or the store or server at `logger.mlflow.tracking_uri`.

The experiment is the W&B group (a sweep's jobs are runs of one experiment, as W&B groups them), or
the W&B project outside a sweep; the run is named as the W&B run, and a resumed run continues the same
MLflow run (its id is kept in `RUN_DIR/mlflow_id.txt`). The flattened config is the run's params
(and `config.json` an artifact), samples are JSON tables (`samples/eval/step_N.json`), the plot an
artifact. MLflow's metric names allow no `@`: `eval/pass@4` is logged as `eval/pass_at_4` (`mlflow_key`).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from rltrain.config.schema import Config
from rltrain.run.samples import TABLE_COLUMNS, Sample
from rltrain.run.trackers.run_config import config_dict, flat_config

MLFLOW_DIR = "mlruns"
PARAM_VALUE_CHARS = 6000  # MLflow's limit on one param's value
BATCH = 100  # params per log_batch call (MLflow's limit; metrics allow 1000)


def mlflow_key(key: str) -> str:
    """A metric key MLflow accepts: `@` spelt `_at_`, any other character it refuses as `_`."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


class MlflowTracker:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()])

    def log_samples(self, key: str, step: int, samples: list[Sample]) -> None:
        table = {"columns": list(TABLE_COLUMNS), "data": [[step, s.prompt, s.completion, s.reward] for s in samples]}
        self.client.log_dict(self.run_id, table, f"{key}/step_{step:08d}.json")  # log_table's own JSON layout

    def log_image(self, key: str, step: int, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=key)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_mlflow(cfg: Config, run_dir: Path, resume_step: int) -> MlflowTracker:
    from mlflow import MlflowClient
    from mlflow.entities import Param

    uri = cfg.logger.mlflow.tracking_uri
    if uri is None:
        # MLflow 3 keeps its file store in maintenance mode behind this opt-in; it is the offline store
        # that needs no database migration at start (docs/trackers.md, "MLflow").
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = (run_dir / MLFLOW_DIR).resolve().as_uri()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # a default registry would be ./mlflow.db
    name = cfg.logger.wandb.group or cfg.logger.wandb.project
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
    id_file = run_dir / "mlflow_id.txt"
    if id_file.exists():
        run_id = id_file.read_text().strip()
        client.update_run(run_id, status="RUNNING")
        return MlflowTracker(client, run_id)
    tags = {"group": cfg.logger.wandb.group} if cfg.logger.wandb.group else {}
    run_id = client.create_run(experiment_id, run_name=cfg.logger.wandb.name or run_dir.name, tags=tags).info.run_id
    id_file.write_text(run_id)
    params = [Param(k, str(v)[:PARAM_VALUE_CHARS]) for k, v in flat_config(cfg).items()]
    for start in range(0, len(params), BATCH):
        client.log_batch(run_id, params=params[start : start + BATCH])
    client.log_dict(run_id, config_dict(cfg), "config.json")
    return MlflowTracker(client, run_id)
