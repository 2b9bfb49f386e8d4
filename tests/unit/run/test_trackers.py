"""What each tracker wrote, read back with the tracker's own reader: TensorBoard's event files
(EventAccumulator), MLflow's file store (MlflowClient), trackio's local database (its SQLite storage).
One MetricsLogger per tracker, a real composed config, the rows, a sample table and a PNG a run logs
(rltrain.run.trackers, docs/trackers.md)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from helpers import compose_config

from rltrain.run.metrics_log import MetricsLogger
from rltrain.run.samples import Sample
from rltrain.run.trackers.mlflow_tracker import mlflow_key
from rltrain.run.trackers.tensorboard_tracker import samples_markdown

# trackio reads TRACKIO_DIR once, when first imported: a test's database never goes to the user's cache.
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="rltrain-trackio-"))

ROWS = [
    {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": float("nan")},
    {"step": 2, "loss": 1.5, "lr": 1e-3, "grad_norm": 0.5},
    {"step": 2, "eval/accuracy": 0.25, "eval/pass@4": 0.75},
]
SAMPLES = [Sample("1+1=", "2", 1.0), Sample("a | b", "line\nbreak", 0.0)]


def log_a_run(run_dir: Path, *overrides: str) -> None:
    cfg = compose_config("algo=sft", "trainer.max_steps=2", "trainer.progress=lines", "logger.wandb.group=sweep-7", *overrides)
    png = run_dir / "plot.png"
    from PIL import Image

    Image.new("RGB", (8, 6), (200, 10, 10)).save(png)
    logger = MetricsLogger(cfg, run_dir, is_main=True, resume_step=0)
    for row in ROWS:
        logger.log(row)
    logger.log_samples("samples/eval", 2, SAMPLES)
    logger.log_image("plots", 2, png)
    logger.close()


def test_tensorboard_holds_the_metrics_config_samples_and_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_a_run(tmp_path, "logger.backends=[tensorboard]")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"loss": [(1, 2.0), (2, 1.5)], "lr": [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3))],
                       "grad_norm": [(2, 0.5)], "eval/accuracy": [(2, 0.25)], "eval/pass@4": [(2, 0.75)]}
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    assert "trainer:\n  max_steps: 2" in texts["config/text_summary"]
    assert "| 2 | a \\| b | line<br>break | 0.0 |" in texts["samples/eval/text_summary"]
    (image,) = events.Images("plots")
    assert (image.step, image.width, image.height) == (2, 8, 6)
    assert "hparams" in events.PluginTagToContent("hparams") or events.PluginTagToContent("hparams")
    assert not (tmp_path / "wandb").exists()  # only what logger.backends names


def test_mlflow_holds_the_metrics_params_samples_and_plot(tmp_path):
    from mlflow import MlflowClient

    log_a_run(tmp_path, "logger.backends=[mlflow]")
    store = (tmp_path / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    experiment = client.get_experiment_by_name("sweep-7")  # the sweep's group, as W&B groups it
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == (tmp_path / "mlflow_id.txt").read_text() and run.info.status == "FINISHED"
    assert run.info.run_name == tmp_path.name and run.data.tags["group"] == "sweep-7"
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
    assert history == {"loss": [(1, 2.0), (2, 1.5)], "lr": [(1, 1e-3), (2, 1e-3)], "grad_norm": [(2, 0.5)],
                       "eval/accuracy": [(2, 0.25)], "eval/pass_at_4": [(2, 0.75)]}
    assert run.data.params["algo.name"] == "sft" and run.data.params["trainer.max_steps"] == "2"
    assert run.data.params["logger.backends"] == "['mlflow']"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "plots", "samples"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/plot.png"]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/eval/step_00000002.json")).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward"]
    assert [row[2] for row in table["data"]] == ["2", "line\nbreak"]


def test_trackio_holds_the_metrics_config_and_group(tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    project = f"rltrain-test-{os.getpid()}-{tmp_path.name}"
    log_a_run(tmp_path, "logger.backends=[trackio]", f"logger.wandb.project={project}")
    logs = SQLiteStorage.get_logs(project, tmp_path.name)
    scalars = [{k: v for k, v in log.items() if k in ("step", "loss", "grad_norm", "eval/pass@4")} for log in logs]
    assert {"step": 1, "loss": 2.0} in scalars and {"step": 2, "loss": 1.5, "grad_norm": 0.5} in scalars
    assert {"step": 2, "eval/pass@4": 0.75} in scalars
    assert any("samples/eval" in log for log in logs) and any("plots" in log for log in logs)
    config = SQLiteStorage.get_run_config(project, tmp_path.name)
    assert config["trainer"]["max_steps"] == 2 and config["logger"]["backends"] == ["trackio"]
    assert config["_Group"] == "sweep-7"  # where trackio keeps a run's group


def test_mlflow_keys_keep_the_names_mlflow_allows():
    assert mlflow_key("eval/pass@16") == "eval/pass_at_16" and mlflow_key("eval/maj@8") == "eval/maj_at_8"
    assert mlflow_key("reward/len<200") == "reward/len_200" and mlflow_key("time/step") == "time/step"


def test_samples_markdown_is_one_row_per_sample():
    assert samples_markdown(SAMPLES, 3).splitlines() == [
        "| step | prompt | completion | reward |", "| --- | --- | --- | --- |",
        "| 3 | 1+1= | 2 | 1.0 |", "| 3 | a \\| b | line<br>break | 0.0 |",
    ]


def test_a_tracker_that_is_not_installed_stops_the_run_with_its_install_command(monkeypatch):
    import importlib.util

    from rltrain.preflight.trackers import validate_trackers
    from rltrain.runtime.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = compose_config("logger.backends=[wandb,mlflow]")
    with pytest.raises(UserError, match=r"names mlflow, which is not installed .*pip install 'mlflow-skinny==3\.17\.2'.*make install"):
        validate_trackers(cfg)
    for backends, message in ((["tensorbored"], "the trackers are wandb, tensorboard, mlflow, trackio"),
                              (["tensorboard", "tensorboard"], "names a tracker twice")):
        cfg.logger.backends = backends
        with pytest.raises(UserError, match=message):
            validate_trackers(cfg)


def test_each_trackers_install_command_is_its_extra_and_its_lock_pin():
    """The requirement the preflight names is the pyproject extra's pin and the CPU lock's."""
    import tomllib

    from rltrain.run.trackers import TRACKERS

    root = Path(__file__).resolve().parents[3]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lock = set((root / "requirements" / "cpu.lock").read_text().splitlines())
    for name, spec in TRACKERS.items():
        assert extras[name] == [spec.install] and spec.install in lock, name
    assert extras["trackers"] == [f"rltrain[{','.join(TRACKERS)}]"]


def test_a_resumed_run_continues_its_mlflow_run_and_tensorboard_drops_the_replayed_steps(tmp_path):
    """Resumed from step 1: TensorBoard purges the events after it (step 2 is logged again, once in
    the end), MLflow continues the run of mlflow_id.txt."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose_config("algo=sft", "trainer.max_steps=3", "trainer.progress=lines", "logger.backends=[tensorboard,mlflow]")
    first = MetricsLogger(cfg, tmp_path, is_main=True, resume_step=0)
    for step in (1, 2):
        first.log({"step": step, "loss": 10.0 + step})
    first.close()  # stopped after step 2; its checkpoint was step 1
    resumed = MetricsLogger(cfg, tmp_path, is_main=True, resume_step=1)
    for step in (2, 3):
        resumed.log({"step": step, "loss": 20.0 + step})
    resumed.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 11.0), (2, 22.0), (3, 23.0)]
    store = (tmp_path / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("rltrain").experiment_id])
    assert run.info.run_id == (tmp_path / "mlflow_id.txt").read_text() and run.info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(history) == [(1, 11.0), (2, 12.0), (2, 22.0), (3, 23.0)]  # MLflow keeps the replayed step's points
