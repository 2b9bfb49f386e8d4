"""The world a run will have (its ranks, those that hold distinct data) and the megatron split of
ranks and model it needs, checked before any rank starts (rltrain.preflight.validate calls
`validate_megatron_split`)."""

from __future__ import annotations

import json
import os

from rltrain.config.hub import local_model_dir
from rltrain.config.schema import Config
from rltrain.runtime.errors import UserError


def world_size(cfg: Config) -> int:
    """The number of ranks the run will have: torchrun's WORLD_SIZE when under torchrun (it, not
    `trainer.nproc`, decides there), else `trainer.nproc`."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return int(os.environ["WORLD_SIZE"])
    return cfg.trainer.nproc


def data_parallel_size(cfg: Config) -> int:
    """Ranks that hold distinct data: all of them, except that megatron's tp x pp ranks share one, and
    FSDP's backend.cp ranks."""
    if cfg.backend.name == "megatron":
        return max(1, world_size(cfg) // (cfg.backend.tp * cfg.backend.pp))
    return max(1, world_size(cfg) // max(1, cfg.backend.cp))


def _model_dims(cfg: Config) -> dict[str, int] | None:
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
        model_dir = local_model_dir("model.path", cfg.model.path, cfg.model.revision)
        hf = json.loads((model_dir / "config.json").read_text())
        heads = int(hf["num_attention_heads"])
        return {
            "num_hidden_layers in model.path's config.json": int(hf["num_hidden_layers"]),
            "num_attention_heads in model.path's config.json": heads,
            "num_key_value_heads in model.path's config.json": int(hf.get("num_key_value_heads") or heads),
            "intermediate_size in model.path's config.json": int(hf["intermediate_size"]),
        }
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None


def model_experts(cfg: Config) -> tuple[str, int] | None:
    """(the key, its value) holding the model's expert count (0 for a dense model): the built tiny
    model's `model.moe.num_experts`, or `model.path`'s config.json; None when that cannot be read here
    (the engine checks then)."""
    if cfg.model.path is None:
        if cfg.model.arch == "qwen3_moe":
            return "model.moe.num_experts", cfg.model.moe.num_experts
        return "model.arch", 0
    try:
        model_dir = local_model_dir("model.path", cfg.model.path, cfg.model.revision)
        hf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError, UserError):
        return None
    for key in ("num_experts", "num_local_experts"):  # Qwen-MoE and OLMoE; Mixtral
        if isinstance(hf.get(key), int):
            return f"{key} in model.path's config.json", hf[key]
    return "num_experts in model.path's config.json", 0


def _validate_expert_split(cfg: Config, world: int) -> None:
    """`backend.ep` splits each layer's experts over ep ranks of one pipeline stage: ep * pp must
    divide the ranks and ep the experts, on a MoE model (docs/moe.md, "Expert parallelism")."""
    pp, ep = cfg.backend.pp, cfg.backend.ep
    if ep < 1:
        raise UserError(f"backend.ep={ep} must be at least 1 (1: no expert parallelism).")
    if world % (ep * pp):
        raise UserError(
            f"backend.ep={ep} does not divide the {world // pp} ranks of each pipeline stage (trainer.nproc={world} / "
            f"backend.pp={pp}): expert parallelism splits a layer's experts over groups of backend.ep data-parallel "
            f"ranks. Set trainer.nproc to a multiple of backend.ep * backend.pp = {ep * pp}, or choose a backend.ep "
            f"that divides {world // pp}."
        )
    experts = model_experts(cfg)
    if experts is None:
        return
    key, count = experts
    if count == 0 and ep > 1:
        raise UserError(
            f"backend.ep={ep} needs a Mixture-of-Experts model; the model names no experts ({key}). Set "
            "backend.ep=1 for a dense model, or train a MoE (model=tiny_moe, or model.path of one)."
        )
    if count and count % ep:
        raise UserError(
            f"backend.ep={ep} does not divide {key}={count}: every rank of an expert-parallel group holds the same "
            f"number of experts. Choose a backend.ep that divides {count}."
        )


def validate_megatron_split(cfg: Config) -> None:
    """`backend=megatron` splits ranks into tp x pp x dp and the model into pp stages of tp shards.

    Caught here, before any rank starts, so the user sees one message naming the key instead of a
    megatron assertion on every rank: ranks divisible by tp*pp; layers divisible by pp; attention
    heads, key/value heads (megatron shards query groups, it does not replicate them) and the MLP
    width divisible by tp. The vocabulary needs no check: the engine pads its rows to a multiple of
    tp and masks the padding out of the log-softmax. Expert parallelism: `_validate_expert_split`.
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
    _validate_expert_split(cfg, world)
    if pp > 1 and ((cfg.model.moe.aux_loss_coef or 0.0) > 0 or cfg.model.moe.z_loss_coef > 0):
        from rltrain.backends.megatron.router_terms import ROUTER_LOSSES_UNDER_PP

        raise UserError(ROUTER_LOSSES_UNDER_PP)
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
