"""`eval.*`: the sampled evaluation's K, its temperature and its k, checked before any model is built
(rltrain.run.sampled_metrics, docs/evaluation.md)."""

from __future__ import annotations

from rltrain.config.algorithms import spec_of
from rltrain.config.schema import Config
from rltrain.runtime.errors import UserError


def validate_eval(cfg: Config) -> None:
    samples, ks = cfg.eval.samples, cfg.eval.k
    if samples < 0:
        raise UserError(f"eval.samples={samples} must be 0 (greedy evaluation only) or K >= 1 sampled completions per held-out prompt.")
    if samples == 0:
        if ks is not None:
            raise UserError(f"eval.k={list(ks)} is set but eval.samples=0 draws no samples: set eval.samples=K (K >= max k).")
        return
    if not spec_of(cfg.algo.name).generates or cfg.env.name != "none":
        raise UserError(
            f"eval.samples={samples} samples completions of the held-out prompts with the rollout engine: GRPO, PPO and the "
            f"other generating algorithms on single-turn prompts (env=none); algo={cfg.algo.name} env={cfg.env.name} "
            "has the greedy evaluation only (docs/evaluation.md). Leave eval.samples=0."
        )
    if cfg.eval.temperature <= 0:
        raise UserError(f"eval.temperature={cfg.eval.temperature} must be > 0: K samples at temperature 0 are K copies of the greedy answer.")
    if ks is not None and (not list(ks) or any(not 1 <= k <= samples for k in ks)):
        raise UserError(f"eval.k={list(ks)}: each k must be between 1 and eval.samples={samples} (pass@k draws k of the K samples).")
