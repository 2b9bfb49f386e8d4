"""Loading a Hugging Face causal LM without a full copy of the model on every rank.

With several FSDP ranks, every rank builds a meta model and allocates its own shards, and rank 0
scatters each rank its rows, so only rank 0 ever holds the full model and no metadata is pickled.
docs/internals/models.md explains the buffers, tied weights and why not `set_model_state_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rltrain.models.vision import is_vision_model_dir, load_vision_lm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    # What AutoModelForCausalLM returns: a PreTrainedModel with GenerationMixin's `generate`.
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as GenerativeLM  # noqa: F401


def load_causal_lm(model_dir: Path, dtype: torch.dtype, on_meta: bool = False) -> PreTrainedModel:
    """The model at `model_dir` in `dtype`, read from disk; or (`on_meta`) its architecture on the
    meta device, with no storage, for `load_sharded_weights` to fill after sharding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if is_vision_model_dir(model_dir):  # AutoModelForImageTextToText (rltrain.models.vision)
        model = load_vision_lm(model_dir, dtype, on_meta)
    elif on_meta:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def load_sharded_weights(
    model: torch.nn.Module,
    model_dir: Path,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    source_name: Callable[[str], str | None] = lambda name: name,
) -> int:
    """Fill `model` (built with `on_meta=True`, sharded, then `to_empty` on its device) with the
    checkpoint at `model_dir`, read by rank 0 of `group` only. Collective over `group`, whose rank 0
    must be global rank 0. `source_name`: the checkpoint's name of each parameter, None for one it
    does not hold (LoRA adapters: rltrain.models.lora). Returns the number of collectives (one per
    parameter and buffer filled)."""
    source = None
    if dist.get_rank() == 0:
        source = load_causal_lm(model_dir, dtype)
    src_params = dict(source.named_parameters()) if source is not None else {}
    src_buffers = dict(source.named_buffers()) if source is not None else {}
    collectives = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            src = source_name(name)
            if src is None:
                continue
            fill_parameter(param, src_params[src] if source is not None else None, group)
            collectives += 1
        for name, buf in model.named_buffers():
            _broadcast_into(buf, src_buffers[name] if source is not None else None, group)
            collectives += 1
    return collectives


def fill_parameter(param: torch.Tensor, full: torch.Tensor | None, group: dist.ProcessGroup | None) -> None:
    """Rank 0's `full` value into `param` on every rank of `group` (collective): each rank receives
    its own rows of an FSDP-sharded parameter, or the whole of a plain one. `full` is read on rank
    0 only (None elsewhere)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            _scatter_rows(param, full)
        else:
            _broadcast_into(param, full, group)


def _broadcast_into(target: torch.Tensor, full: torch.Tensor | None, group) -> None:
    """Rank 0's `full` into `target` on every rank of `group`."""
    if full is not None:
        target.copy_(full)
    dist.broadcast(target.data, group_src=0, group=group)


def _scatter_rows(param, full: torch.Tensor | None) -> None:
    """Rank 0's `full` tensor into a DTensor sharded on dim 0 over a 1-D mesh: each rank receives
    its chunk only (chunks of ceil(rows / ranks) rows, the last ones shorter or empty, as `Shard(0)`
    lays them out)."""
    from torch.distributed.tensor import Shard

    if tuple(param.placements) != (Shard(0),):
        raise NotImplementedError(f"loading a parameter placed as {param.placements}; only Shard(0) is supported")
    group = param.device_mesh.get_group()
    world = dist.get_world_size(group)
    local = param.to_local()
    rows = -(-param.shape[0] // world)  # rows per chunk, padded
    out = torch.empty((rows, *param.shape[1:]), dtype=local.dtype, device=local.device)
    chunks = None
    if full is not None:
        padded = torch.zeros((rows * world, *param.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: param.shape[0]].copy_(full)
        chunks = list(padded.chunk(world))
    dist.scatter(out, chunks, group_src=0, group=group)
    local.copy_(out[: local.shape[0]])
