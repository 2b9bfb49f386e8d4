"""A run that evaluates and stops (`eval.only=true`, what `python -m rltrain.eval` sets): the model of
`model.path` (a run's `final/`, any Hugging Face directory or Hub id) evaluated once, at step 0, by the
algorithm's own evaluation (its engine, rewards, environments, `eval.samples`), with nothing trained.
Rank 0 writes the row to metrics.jsonl and the trackers as a run would, `RUN_DIR/eval.json`, and a
table on the console. docs/evaluation.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rltrain.config.run_context import RunContext
from rltrain.config.schema import Config
from rltrain.run.algorithm import Algorithm
from rltrain.run.metrics_log import MetricsLogger

RESULTS_FILE = "eval.json"


def results_table(metrics: dict[str, float]) -> str:
    """`metric | value` lines, the keys in the order the evaluation returned them."""
    width = max([len("metric"), *map(len, metrics)])
    lines = [f"{'metric':<{width}} | value", f"{'-' * width}-|-------"]
    return "\n".join(lines + [f"{key:<{width}} | {value:.4f}" for key, value in metrics.items()])


def results(cfg: Config, model_dir: Path, metrics: dict[str, float]) -> dict[str, Any]:
    """What eval.json holds: the model evaluated, on which data, how, and the metrics."""
    return {
        "model": str(model_dir), "algo": cfg.algo.name, "data": cfg.data.path or f"built-in:{cfg.data.task}",
        "eval_samples": cfg.eval.samples, "eval_temperature": cfg.eval.temperature, "metrics": metrics,
    }


def evaluate_only(ctx: RunContext, algo: Algorithm) -> None:
    cfg, run_dir = ctx.cfg, ctx.run_dir
    logger = MetricsLogger(cfg, run_dir, ctx.dist.is_main, resume_step=0)
    try:
        metrics = algo.evaluate(0)
        logger.log({"step": 0, **metrics})
        logger.log_samples("samples/eval", 0, algo.samples())
    finally:
        logger.close()
    if ctx.dist.is_main:
        (run_dir / RESULTS_FILE).write_text(json.dumps(results(cfg, ctx.model_dir, metrics), indent=2) + "\n")
        print(results_table(metrics), flush=True)
        print(f"rltrain: evaluated {ctx.model_dir}; results in {run_dir / RESULTS_FILE}", flush=True)
