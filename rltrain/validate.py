"""Checks across keys that a schema cannot express, run before any model is built.

Types and key names are already enforced by the structured config while Hydra composes; this
catches values that are well-typed but unusable, with a message naming the key and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rltrain.errors import UserError

CHOICES = {
    "trainer.resume": ("auto", "never"),
    "trainer.progress": ("auto", "bar", "lines"),
    "data.overlong": ("drop", "truncate", "error"),
    "logger.wandb.mode": ("auto", "online", "offline", "disabled"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "model.arch": ("qwen2", "llama"),
    "trainer.precision": ("auto", "fp32", "bf16-mixed", "bf16"),  # rltrain.precision.PRECISIONS (no torch here)
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
    if cfg.trainer.max_tokens_per_micro_batch < 0:
        raise UserError(
            f"trainer.max_tokens_per_micro_batch={cfg.trainer.max_tokens_per_micro_batch} must be 0 (no token budget) "
            "or a positive number of tokens."
        )
    if cfg.trainer.keep_checkpoints < 1:
        raise UserError(
            f"trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} must be at least 1: it is how many of the "
            "newest checkpoints are kept, and the one just written is always among them. To save none, set "
            "trainer.save_every=0 (the last step is still saved for resume)."
        )
    validate_megatron_layout(cfg)
    if cfg.trainer.global_batch_size < data_parallel_size(cfg):
        raise UserError(
            f"trainer.global_batch_size={cfg.trainer.global_batch_size} is smaller than the {data_parallel_size(cfg)} "
            "data-parallel ranks: every rank needs at least one example per step. Raise the batch or lower "
            "trainer.nproc."
        )
    if cfg.optim.lr <= 0:
        raise UserError(f"optim.lr={cfg.optim.lr} must be positive.")
    if cfg.reward.timeout_s is not None and cfg.reward.timeout_s < 0:
        raise UserError(f"reward.timeout_s={cfg.reward.timeout_s} must be positive (seconds), or 0 / null for no limit.")
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
    if cfg.rollout is not None and cfg.rollout.name == "vllm" and cfg.rollout.process not in ("colocated", "separate"):
        raise UserError(
            f"rollout.process={cfg.rollout.process!r} is not one of colocated, separate (the vLLM engine in "
            "the trainer's process, or in a child process of its own)."
        )
    if cfg.rollout is not None and cfg.rollout.name == "vllm":
        validate_vllm(cfg.rollout)
    from rltrain.safety.faults import parse_faults

    parse_faults(cfg.debug.fault)  # a malformed debug.fault fails here, before any model is built
    for key in ("data.path", "data.eval_path"):
        value = _get(cfg, key)
        if value is not None and not Path(value).expanduser().exists():
            raise UserError(
                f"{key}={value!r} does not exist. Give a .jsonl or .parquet file or a directory saved with "
                "datasets' save_to_disk."
            )


def validate_vllm(rollout) -> None:
    """The vLLM engine's CUDA settings (README, "vLLM on CUDA"); checked on every machine, so a
    config that would fail on the cluster fails on a laptop first."""
    util = rollout.gpu_memory_utilization
    if not 0 < util <= 1:
        raise UserError(
            f"rollout.gpu_memory_utilization={util} must be in (0, 1]: the fraction of the GPU's memory the vLLM "
            "engine may take for its weights, activations and KV cache (e.g. 0.5 when the trainer shares the GPU)."
        )
    if rollout.sleep_level not in (1, 2):
        raise UserError(
            f"rollout.sleep_level={rollout.sleep_level} is not 1 or 2: vLLM's sleep between rollout turns either "
            "keeps the weights in host memory (1) or discards them, to be sent again after the wake (2)."
        )
    if rollout.tensor_parallel_size < 1:
        raise UserError(f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} must be at least 1.")
    if rollout.max_model_len is not None and rollout.max_model_len < 1:
        raise UserError(
            f"rollout.max_model_len={rollout.max_model_len} must be at least 1, or null for the model's own limit."
        )


def world_size(cfg) -> int:
    """The number of ranks the run will have: torchrun's WORLD_SIZE when under torchrun (it, not
    `trainer.nproc`, decides there), else `trainer.nproc`."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return int(os.environ["WORLD_SIZE"])
    return cfg.trainer.nproc


def data_parallel_size(cfg) -> int:
    """Ranks that hold distinct data: all of them, except that megatron's tp x pp ranks share one."""
    if cfg.backend.name == "megatron":
        return max(1, world_size(cfg) // (cfg.backend.tp * cfg.backend.pp))
    return world_size(cfg)


def _model_dims(cfg) -> dict[str, int] | None:
    """Layer/head/MLP sizes under the config keys that set them (the tiny model's, or those of
    `model.path`'s config.json); None when they cannot be read here (the engine checks then)."""
    if cfg.model.path is None:
        m = cfg.model
        return {
            "model.num_layers": m.num_layers,
            "model.num_heads": m.num_heads,
            "model.num_kv_heads": m.num_kv_heads,
            "model.intermediate_size": m.intermediate_size,
        }
    try:
        hf = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text())
        heads = int(hf["num_attention_heads"])
        return {
            "num_hidden_layers in model.path's config.json": int(hf["num_hidden_layers"]),
            "num_attention_heads in model.path's config.json": heads,
            "num_key_value_heads in model.path's config.json": int(hf.get("num_key_value_heads") or heads),
            "intermediate_size in model.path's config.json": int(hf["intermediate_size"]),
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None


def validate_megatron_layout(cfg) -> None:
    """`backend=megatron` splits ranks into tp x pp x dp and the model into pp stages of tp shards.

    Caught here, before any rank starts, so the user sees one message naming the key instead of a
    megatron assertion on every rank: ranks divisible by tp*pp; layers divisible by pp; attention
    heads, key/value heads (megatron shards query groups, it does not replicate them) and the MLP
    width divisible by tp. The vocabulary needs no check: the engine pads its rows to a multiple of
    tp and masks the padding out of the log-softmax.
    """
    if cfg.backend.name != "megatron":
        return
    tp, pp = cfg.backend.tp, cfg.backend.pp
    for key, value in (("backend.tp", tp), ("backend.pp", pp)):
        if value < 1:
            raise UserError(f"{key}={value} must be at least 1.")
    world = world_size(cfg)
    if world % (tp * pp):
        source = "the torchrun world size" if world != cfg.trainer.nproc else "trainer.nproc"
        raise UserError(
            f"{source}={world} is not divisible by backend.tp * backend.pp = {tp} * {pp} = {tp * pp}: megatron runs "
            f"nproc / (tp * pp) data-parallel replicas of tp * pp ranks each. Set trainer.nproc to a multiple of "
            f"{tp * pp}, or choose backend.tp and backend.pp whose product divides {world}."
        )
    dims = _model_dims(cfg)
    if dims is None:
        return
    layers_key, heads_key, kv_key, ffn_key = dims
    if dims[layers_key] % pp:
        raise UserError(
            f"backend.pp={pp} does not divide {layers_key}={dims[layers_key]}: every pipeline stage holds the same "
            f"number of decoder layers. Choose a backend.pp that divides {dims[layers_key]}."
        )
    for key in (heads_key, kv_key, ffn_key):
        if dims[key] % tp:
            raise UserError(
                f"backend.tp={tp} does not divide {key}={dims[key]}: tensor parallelism shards attention heads, "
                f"key/value heads and the MLP evenly over tp ranks. Choose a backend.tp that divides "
                f"{heads_key}, {kv_key} and {ffn_key} ({dims[heads_key]}, {dims[kv_key]}, {dims[ffn_key]})."
            )
