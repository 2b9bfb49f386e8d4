"""Checks of `placement.weight_update`, `placement.stream` and `placement.deterministic` (docs/async.md,
"Weights in flight"): each combination that cannot work is refused before anything is built, with
the fix named. rltrain/preflight/validate.py calls `validate_in_flight` after `validate_staleness`.
"""

from __future__ import annotations

from rltrain.algos.rl.config import RLConfig
from rltrain.config.group_choice import as_option
from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.schema import Config
from rltrain.runtime.errors import UserError


def validate_in_flight(cfg: Config) -> None:
    p = cfg.placement
    if p.weight_update == "between_batches":
        if p.stream:
            raise UserError(
                "placement.stream=true hands the trainer the first groups to complete while the engine keeps generating, "
                "which needs an engine that takes new weights between its decoding steps. Add placement.weight_update=in_flight "
                "(with rollout=vllm rollout.process=separate or rollout=server, and placement.max_staleness >= 1), or set "
                "placement.stream=false."
            )
        return  # between batches the schedule is deterministic already, with or without placement.deterministic
    vllm = as_option("rollout", cfg.rollout, VLLMRolloutConfig)
    servers = cfg.rollout.name == "server"
    if not servers and (vllm is None or vllm.process != "separate"):
        raise UserError(
            f"placement.weight_update=in_flight needs an engine beside the trainer that loads weights between its decoding "
            f"steps: rollout=vllm rollout.process=separate, or rollout=server (rollout={cfg.rollout.name} shares the "
            "trainer's process). Add one of them, or set placement.weight_update=between_batches."
        )
    if servers and p.deterministic:
        raise UserError(
            "placement.deterministic=true loads each version at a decoding step fixed by counts, which only the separate "
            "engine's own step loop can do: vLLM's API servers (rollout=server) schedule their own steps, so which tokens a "
            "version samples there depends on timing (docs/async.md). Set placement.deterministic=false (the per-token "
            "staleness bound holds either way), or use rollout=vllm rollout.process=separate."
        )
    if p.max_staleness < 1:
        raise UserError(
            f"placement.weight_update=in_flight with placement.max_staleness={p.max_staleness}: a version can only arrive while "
            "the engine generates if it generates ahead of the trainer, and the bound on every token's staleness is "
            "placement.max_staleness. Set placement.max_staleness=1 (or more), or placement.weight_update=between_batches."
        )
    _refuse_unsupported(cfg)
    if p.update_lag_steps < 0:
        raise UserError(f"placement.update_lag_steps={p.update_lag_steps} must be a number of decode steps >= 0.")


def _refuse_unsupported(cfg: Config) -> None:
    """What the in-flight loop does not drive: each named with the way out."""
    fix = "or set placement.weight_update=between_batches (generating ahead supports it)."
    if cfg.env.name != "none":
        raise UserError(
            f"placement.weight_update=in_flight generates single-turn groups; env={cfg.env.name} plays multi-turn episodes. "
            f"Use env=none, {fix}"
        )
    if cfg.data.path is None and cfg.data.task == "colours":  # a dataset's images are found when its prompts are submitted
        raise UserError(
            "placement.weight_update=in_flight submits token ids only, and data.task=colours prompts with pictures "
            "(docs/vision.md). Set placement.weight_update=between_batches (generating ahead carries images)."
        )
    rl = as_option("algo", cfg.algo, RLConfig)
    if rl is not None and rl.dynamic_sampling:
        raise UserError(f"placement.weight_update=in_flight does not resample groups (algo.dynamic_sampling=true). Set algo.dynamic_sampling=false, {fix}")
    if cfg.trainer.nproc != 1:
        raise UserError(
            f"placement.weight_update=in_flight streams one trainer rank's groups; trainer.nproc={cfg.trainer.nproc}. With "
            "several ranks each would fill its own batches in completion order, and a version pushed mid-generation "
            "would have to reach every rank's requests at one decoding step, which is not built (docs/async.md). "
            f"Set trainer.nproc=1, {fix}"
        )
