"""Checks across keys that a schema cannot express, run before any model is built.

Types and key names are already enforced by the structured config while Hydra composes; this
catches values that are well-typed but unusable, with a message naming the key and the fix.
"""

from __future__ import annotations

from pathlib import Path

from rltrain.errors import UserError

CHOICES = {
    "trainer.resume": ("auto", "never"),
    "trainer.progress": ("auto", "bar", "lines"),
    "data.overlong": ("drop", "truncate", "error"),
    "logger.wandb.mode": ("auto", "online", "offline", "disabled"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "model.arch": ("qwen2", "llama"),
    "model.dtype": ("float32", "bfloat16"),
}


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate(cfg) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}.")
    positive = ["trainer.max_steps", "trainer.nproc", "trainer.global_batch_size", "trainer.micro_batch_size", "data.max_length"]
    for key in positive:
        if _get(cfg, key) < 1:
            raise UserError(f"{key}={_get(cfg, key)} must be at least 1.")
    if cfg.trainer.global_batch_size < cfg.trainer.nproc:
        raise UserError(
            f"trainer.global_batch_size={cfg.trainer.global_batch_size} is smaller than trainer.nproc={cfg.trainer.nproc}: "
            "every rank needs at least one example per step. Raise the batch or lower nproc."
        )
    if cfg.optim.lr <= 0:
        raise UserError(f"optim.lr={cfg.optim.lr} must be positive.")
    if cfg.model.path is not None and not (Path(cfg.model.path).expanduser() / "config.json").exists():
        raise UserError(
            f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json). Point it at a "
            "directory written by save_pretrained, or leave it unset for the built-in tiny model."
        )
    if cfg.safety.collective_timeout_s <= 0 or cfg.safety.max_consecutive_errors < 0:
        raise UserError(
            f"safety.collective_timeout_s={cfg.safety.collective_timeout_s} must be positive and "
            f"safety.max_consecutive_errors={cfg.safety.max_consecutive_errors} at least 0."
        )
    from rltrain.safety.faults import parse_faults

    parse_faults(cfg.debug.fault)  # a malformed debug.fault fails here, before any model is built
    for key in ("data.path", "data.eval_path"):
        value = _get(cfg, key)
        if value is not None and not Path(value).expanduser().exists():
            raise UserError(
                f"{key}={value!r} does not exist. Give a .jsonl or .parquet file or a directory saved with "
                "datasets' save_to_disk."
            )
