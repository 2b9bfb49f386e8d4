"""What the console says while a run logs (rltrain.run.metrics_log), with a real Hydra config and a real
offline W&B run: each line shows the step out of the total, W&B says where its offline run went and
how to upload it, and W&B's Weave advert (triggered by vLLM's import of openai) stays off."""

from __future__ import annotations

import pytest
from helpers import compose_config

from rltrain.run.metrics_log import MetricsLogger


def test_lines_show_progress_and_the_offline_wandb_run_is_named(tmp_path, capfd, monkeypatch):
    pytest.importorskip("openai")  # what a GRPO run with vLLM has imported when W&B starts
    monkeypatch.delenv("WANDB_DISABLE_WEAVE", raising=False)  # and restored afterwards
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = compose_config(
        "algo=sft", "trainer.max_steps=3", "trainer.log_every=1", "trainer.progress=lines", "logger.wandb.mode=auto"
    )
    logger = MetricsLogger(cfg, tmp_path, is_main=True, resume_step=0)
    for step in (1, 2, 3):
        logger.log({"step": step, "loss": 1.0 / step, "lr": 1e-3})
    logger.log({"step": 3, "eval/accuracy": 0.5})
    logger.close()
    out, err = capfd.readouterr()

    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("step ")] == [
        "step 1/3", "step 2/3", "step 3/3", "step 3/3"
    ]
    (offline_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert f"rltrain: W&B run saved offline in {offline_dir}; upload it with `wandb sync {offline_dir}`" in out
    assert "Weave" not in out + err
