"""One GRPO run with all four trackers and the sampled evaluation: `eval/pass@k`, `eval/mean@K` and
`eval/maj@K` beside greedy `eval/accuracy` in metrics.jsonl, and the same numbers (and the run's plot)
read back from each tracker's own files (docs/trackers.md, docs/evaluation.md)."""

from __future__ import annotations

import json

import pytest
from cli import GRPO_RUN, python, read_metrics, rltrain
from wandb_reader import find_run_file, read_offline_run

pytestmark = pytest.mark.e2e

KEYS = ("eval/pass@1", "eval/pass@4", "eval/mean@4", "eval/maj@4", "eval/accuracy")


def test_a_grpo_run_logs_its_sampled_evaluation_to_every_tracker(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trackio import sqlite_storage

    run_dir, trackio_dir = tmp_path / "run", tmp_path / "trackio"
    rltrain(*GRPO_RUN, "trainer.max_steps=2", "trainer.save_every=0", "eval.samples=4", "eval.temperature=1.0",
            "logger.backends=[wandb,tensorboard,mlflow,trackio]", "logger.wandb.mode=offline",
            "logger.wandb.project=e2e-trackers", "logger.plot=true", run_dir=run_dir, env={"TRACKIO_DIR": str(trackio_dir)}, timeout=600)

    evals = {r["step"]: {k: r[k] for k in KEYS} for r in read_metrics(run_dir) if "eval/pass@1" in r}
    assert sorted(evals) == [0, 2]
    for row in evals.values():
        assert 0.0 <= row["eval/pass@1"] <= row["eval/pass@4"] <= 1.0 and 0.0 <= row["eval/maj@4"] <= 1.0

    history = read_offline_run(find_run_file(run_dir))["history"]
    assert {step: {k: history[step][k] for k in KEYS} for step in evals} == evals

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    for key in KEYS:  # TensorBoard keeps float32
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(step, pytest.approx(evals[step][key], rel=1e-6)) for step in sorted(evals)]
    assert [image.step for image in events.Images("plots")] == [2]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked (docs/trackers.md)
    store = (run_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    run_id = (run_dir / "mlflow_id.txt").read_text()
    mlflow_rows = {k: {m.step: m.value for m in client.get_metric_history(run_id, k.replace("@", "_at_"))} for k in KEYS}
    assert {step: {k: mlflow_rows[k][step] for k in KEYS} for step in evals} == evals
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/plots.png"]

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", trackio_dir)  # the run's database, not this process's
    logs = sqlite_storage.SQLiteStorage.get_logs("e2e-trackers", run_dir.name)
    trackio_rows = {log["step"]: log for log in logs if "eval/pass@1" in log}
    assert {step: {k: trackio_rows[step][k] for k in KEYS} for step in evals} == evals


def test_rltrain_eval_evaluates_a_model_without_training(tmp_path):
    """`python -m rltrain.eval`: one evaluation row at step 0, eval.json and the table; nothing trained."""
    run_dir = tmp_path / "eval"
    proc = python("-m", "rltrain.eval", *GRPO_RUN, "eval.samples=2", f"hydra.run.dir={run_dir}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_metrics(run_dir)
    assert row["step"] == 0 and {"eval/accuracy", "eval/reward", "eval/pass@1", "eval/pass@2", "eval/maj@2"} <= set(row)
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["metrics"] == {k: v for k, v in row.items() if k != "step"} and results["eval_samples"] == 2
    assert "eval/pass@2 " in proc.stdout and "metric" in proc.stdout
    assert not (run_dir / "final").exists() and not (run_dir / "checkpoints").exists()
