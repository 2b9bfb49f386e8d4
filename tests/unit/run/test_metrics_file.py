"""`metrics.jsonl` holds numbers or null, never a non-finite value as a string or as JSON's
non-standard NaN/Infinity (rltrain.run.metrics_log): a skipped step's grad_norm, an infinite metric."""

from __future__ import annotations

import json

import pytest
from helpers import compose_config

from rltrain.run.metrics_log import MetricsLogger


def _strict(line: str) -> dict:
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("progress", ["lines", "bar"])
def test_a_non_finite_value_is_written_as_null(tmp_path, progress):
    cfg = compose_config("algo=sft", "trainer.max_steps=2", "logger.wandb.mode=disabled", f"trainer.progress={progress}")
    logger = MetricsLogger(cfg, tmp_path, is_main=True, resume_step=0)
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "rollout/is_ratio_max": float("-inf"), "lr": 1e-3})
    logger.log({"step": 2, "loss": 0.5, "grad_norm": 1.0, "rollout/is_ratio_max": 1.0, "lr": 1e-3})
    logger.close()
    first, second = (_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first == {"step": 1, "loss": None, "grad_norm": None, "rollout/is_ratio_max": None, "lr": 1e-3}
    assert second == {"step": 2, "loss": 0.5, "grad_norm": 1.0, "rollout/is_ratio_max": 1.0, "lr": 1e-3}
