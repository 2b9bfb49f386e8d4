"""`backend.cp` checked before any rank starts: what context parallelism needs of the ranks, the
backend and the model, each refusal one paragraph naming the key and the fix (docs/long-sequences.md)."""

from __future__ import annotations

import json

from rltrain.config.hub import local_model_dir
from rltrain.config.schema import Config
from rltrain.preflight.world import model_experts, world_size
from rltrain.runtime.errors import UserError


def _model_facts(cfg: Config) -> dict | None:
    """(heads key, heads, vision?) of the tiny model or `model.path`'s config.json; None when unreadable here."""
    if cfg.model.path is None:
        return {"heads_key": "model.num_heads", "heads": cfg.model.num_heads, "vision": cfg.model.arch == "qwen2_vl"}
    try:
        hf = json.loads((local_model_dir("model.path", cfg.model.path, cfg.model.revision) / "config.json").read_text())
    except (OSError, ValueError, UserError):
        return None
    text = hf.get("text_config") or hf
    return {
        "heads_key": "num_attention_heads in model.path's config.json",
        "heads": int(text.get("num_attention_heads", 0) or 0),
        "vision": hf.get("vision_config") is not None,
        "sliding": bool(text.get("use_sliding_window")),
    }


def validate_context_parallel(cfg: Config) -> None:
    """backend.cp >= 1; above 1: the FSDP backend, at least cp ranks and a multiple of them, attention
    heads divisible by cp, a dense text-only model with full attention."""
    cp = cfg.backend.cp
    if cp < 1:
        raise UserError(f"backend.cp={cp} must be at least 1 (1: every rank holds whole sequences).")
    if cp == 1:
        return
    if cfg.backend.name == "megatron":
        raise UserError(
            f"backend=megatron backend.cp={cp}: megatron-core's context parallelism runs only in Transformer "
            "Engine's attention (its local DotProductAttention asserts context_parallel_size == 1), and this build "
            "has no Transformer Engine. Use backend=fsdp backend.cp=N (Ulysses sequence parallelism over the "
            "ranks, docs/long-sequences.md), or backend.cp=1 with megatron's tp/pp."
        )
    world = world_size(cfg)
    if world == 1:
        raise UserError(
            f"backend.cp={cp} on one rank: context parallelism splits each sequence over backend.cp ranks, and this "
            f"run has one. Set trainer.nproc={cp} (or a multiple of it), or backend.cp=1."
        )
    if world % cp:
        raise UserError(
            f"backend.cp={cp} does not divide the {world} ranks (trainer.nproc or torchrun's world size): the ranks "
            f"form groups of backend.cp consecutive ranks, each group one data-parallel replica splitting its "
            f"sequences. Set trainer.nproc to a multiple of {cp}, or choose a backend.cp that divides {world}."
        )
    experts = model_experts(cfg)
    if experts is not None and experts[1]:
        raise UserError(
            f"backend.cp={cp} with a Mixture-of-Experts model ({experts[0]}={experts[1]}): its router losses and "
            "router replay are computed over whole rows, which a split row does not have. Set backend.cp=1 for MoE."
        )
    facts = _model_facts(cfg)
    if facts is None:
        return  # the engine checks the heads when it loads the model
    if facts["vision"]:
        raise UserError(
            f"backend.cp={cp} with a vision-language model: its image features are placed on whole rows, which "
            "context parallelism splits. Set backend.cp=1 for vision-language models."
        )
    if facts.get("sliding"):
        raise UserError(
            f"backend.cp={cp} with sliding-window attention (use_sliding_window in model.path's config.json): "
            "the split attention is full causal attention only. Set backend.cp=1 for this model."
        )
    heads_key, heads = facts["heads_key"], facts["heads"]
    if heads % cp:
        raise UserError(
            f"backend.cp={cp} does not divide {heads_key}={heads}: Ulysses attention gives each of the cp ranks an "
            f"equal share of the attention heads over the whole sequence (key/value heads that cp does not divide "
            f"are repeated). Choose a backend.cp that divides {heads}."
        )
