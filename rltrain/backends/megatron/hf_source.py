"""Reading a Hugging Face model directory for megatron: its spec, checked against the split over
tp and pp with a clear error, and its safetensors one tensor at a time (convert.py picks the shards)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from rltrain.backends.megatron.spec import ModelSpec
from rltrain.runtime.errors import UserError


def hf_reader(model_dir: Path):
    """get(name) -> tensor over the directory's safetensors files, reading one tensor at a time."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights (the megatron backend reads only those)")
    index: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                index[name] = path

    def get(name: str) -> torch.Tensor:
        if name not in index:
            raise KeyError(f"{model_dir} has no tensor {name!r}")
        with safe_open(str(index[name]), framework="pt") as f:
            return f.get_tensor(name)

    return get


def checked_spec(model_dir: Path, tp: int, pp: int, ep: int = 1) -> ModelSpec:
    """The model's spec, or a UserError naming the key to change. `rltrain.preflight.validate` catches most
    of this before any rank starts; this covers what it cannot read (an unsupported architecture,
    a config.json it could not parse) and callers that bypass it (torchrun, the Python API)."""
    from transformers import AutoConfig

    try:
        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
        spec.check_split(tp, pp, ep)
    except ValueError as exc:
        raise UserError(
            f"backend=megatron cannot run the model in {model_dir}: {exc}. Change backend.tp/backend.pp/backend.ep, or use "
            "backend=fsdp for an architecture the megatron backend does not convert."
        ) from exc
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % (tp * pp):
        raise UserError(
            f"backend=megatron: {world} ranks are not divisible by backend.tp * backend.pp = {tp * pp}. Set "
            f"trainer.nproc (or torchrun's --nproc_per_node) to a multiple of {tp * pp}."
        )
    if world % (ep * pp):
        raise UserError(
            f"backend=megatron: {world} ranks are not divisible by backend.ep * backend.pp = {ep * pp} (each "
            f"pipeline stage's ranks split a layer's experts into groups of backend.ep). Set trainer.nproc (or "
            f"torchrun's --nproc_per_node) to a multiple of {ep * pp}, or change backend.ep."
        )
    return spec
