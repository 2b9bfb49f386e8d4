"""Which Hugging Face directory a run loads: `model.path` (a directory, or a Hub id's cached
snapshot: rltrain/config/hub.py), the SFT'd tiny model, or the tiny model.

One place decides, so every rank (rank 0 builds, the others read the cache afterwards:
rltrain/run/trainer.py prepare_model_dir) resolves the same directory.
"""

from __future__ import annotations

from pathlib import Path

from rltrain.config.hub import local_model_dir
from rltrain.config.schema import DataConfig, ModelConfig, TrainerConfig
from rltrain.models.tiny import build_tiny_model_dir
from rltrain.models.tiny_moe import build_tiny_moe_model_dir
from rltrain.models.tiny_sft import build_sft_model_dir
from rltrain.models.tiny_vl import build_tiny_vl_model_dir


def resolve_model_dir(model_cfg: ModelConfig, data_cfg: DataConfig, trainer_cfg: TrainerConfig) -> Path:
    """`model.path` (a Hub id resolved to its snapshot; the tiny model's keys, SFT included, are unused then); else the tiny
    model (or tiny vision-language model, or tiny MoE), after its short SFT when `model.sft_steps > 0` (model=tiny_sft,
    tiny_vl_sft, tiny_moe_sft)."""
    if model_cfg.path is None:
        if model_cfg.sft_steps:  # model=tiny_sft, tiny_vl_sft (arch qwen2_vl) or tiny_moe_sft (qwen3_moe)
            return build_sft_model_dir(model_cfg, data_cfg, trainer_cfg)
        if model_cfg.arch == "qwen2_vl":
            return build_tiny_vl_model_dir(model_cfg, trainer_cfg.seed)
        if model_cfg.arch == "qwen3_moe":
            return build_tiny_moe_model_dir(model_cfg, trainer_cfg.seed)
        return build_tiny_model_dir(model_cfg, trainer_cfg.seed)
    path = local_model_dir("model.path", model_cfg.path, model_cfg.revision)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.path={model_cfg.path!r} is not a Hugging Face model directory (no config.json there). "
            "Point model.path at a directory saved with save_pretrained, or leave it null for the "
            "built-in tiny model."
        )
    return path
