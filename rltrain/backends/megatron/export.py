"""Stream full Hugging Face tensors out of a tp x pp (x ep) sharded model; write a HF directory.

Every rank knows every shard shape from the config, so tensors are exchanged with no metadata on
the wire, to every rank (weight sync) or to rank 0 (saving). A MoE's experts are gathered over the
expert-parallel group, whose ranks belong to different data-parallel replicas, so when saving
those replicas take part in the gathers too. The generator issues collectives: every rank must
exhaust it. docs/internals/backends.md describes both modes, docs/moe.md the experts. A reward model is
written as a sequence classifier (docs/algorithms.md, "Reward model").
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rltrain.backends.megatron.convert import (
    VALUE_HEAD_WEIGHT,
    is_expert,
    megatron_shape,
    megatron_to_hf,
    split_dim,
    stage_param_names,
)
from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.backends.megatron.spec import ModelSpec
from rltrain.backends.sequence_classifier import write_sequence_classifier
from rltrain.runtime import distributed as p2p
from rltrain.runtime.distributed import control_device

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _owner_items(
    params: dict[str, torch.nn.Parameter], spec: ModelSpec, name: str, coords: ParallelCoords, offset: int
) -> list[tuple[str, torch.Tensor]]:
    local = params[name].detach()
    if is_expert(name):
        return _expert_items(local, spec, name, coords, offset)
    if split_dim(name) is None or coords.tp == 1:
        shards = [local]
    else:
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(coords.tp)]
        dist.all_gather(shards, local, group=coords.tp_group)
    return [(n, t.clone(memory_format=torch.contiguous_format)) for n, t in megatron_to_hf(spec, name, shards, offset)]


def _expert_items(
    local: torch.Tensor, spec: ModelSpec, name: str, coords: ParallelCoords, offset: int
) -> list[tuple[str, torch.Tensor]]:
    """One local expert index's weights from every rank of the expert-parallel group (collective)."""
    per_rank = [local]
    if coords.ep > 1:
        per_rank = [torch.empty_like(local) for _ in range(coords.ep)]
        dist.all_gather(per_rank, local.contiguous(), group=coords.ep_group)
    block = spec.local_experts(coords.ep)
    return [
        (n, t.clone(memory_format=torch.contiguous_format))
        for ep_rank, weight in enumerate(per_rank)
        for n, t in megatron_to_hf(spec, name, [weight], offset, first_expert=ep_rank * block)
    ]


def _remote_items(
    spec: ModelSpec, name: str, coords: ParallelCoords, offset: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    meta = [torch.empty(megatron_shape(spec, name, coords.tp), dtype=dtype, device="meta")] * coords.tp
    experts_from = [r * spec.local_experts(coords.ep) for r in range(coords.ep)] if is_expert(name) else [0]
    return [
        (n, torch.empty(t.shape, dtype=dtype, device=device))
        for first in experts_from
        for n, t in megatron_to_hf(spec, name, meta, offset, first_expert=first)
    ]


def export_weights(
    model: torch.nn.Module, spec: ModelSpec, coords: ParallelCoords, to_rank0: bool = False, output: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors (see the module docstring); `output=False`: a value model's stages, which
    hold no output layer."""
    params = dict(model.named_parameters())
    first = next(iter(params.values()))
    dtype, device = first.dtype, first.device
    # Saving: replica 0 communicates; the others only lend it their experts (expert-parallel gathers).
    experts_only = to_rank0 and coords.dp_rank != 0
    if experts_only and coords.ep == 1:
        return
    pp_ranks = dist.get_process_group_ranks(coords.pp_group) if coords.pp > 1 else [dist.get_rank()]
    me = dist.get_rank()
    for stage in range(coords.pp):
        offset = spec.stage_layers(stage, coords.pp).start
        owner = stage == coords.pp_rank
        for name in stage_param_names(spec, stage, coords.pp, output, coords.ep):
            if experts_only:
                if owner and is_expert(name):
                    _expert_items(params[name].detach(), spec, name, coords, offset)
                continue
            if owner:
                items = _owner_items(params, spec, name, coords, offset)
            elif not to_rank0:
                items = _remote_items(spec, name, coords, offset, dtype, device)
            elif me == 0:
                items = _remote_items(spec, name, coords, offset, dtype, device)
            else:
                continue
            for hf_name, tensor in items:
                if coords.pp > 1 and not to_rank0:
                    dist.broadcast(tensor, src=pp_ranks[stage], group=coords.pp_group)
                elif coords.pp > 1 and stage != 0 and coords.tp_rank == 0:
                    if owner:
                        p2p.isend(tensor, dst=pp_ranks[0], group=coords.pp_group).wait()
                    elif coords.pp_rank == 0:
                        p2p.recv(tensor, src=pp_ranks[stage], group=coords.pp_group)
                if not to_rank0 or me == 0:
                    yield hf_name, tensor


def save_pretrained(
    model: torch.nn.Module, spec: ModelSpec, coords: ParallelCoords, source_dir: Path, directory: Path
) -> None:
    """Write a HF model directory (rank 0): config and tokenizer files copied from the source
    directory, weights as one safetensors file. Collective; every rank returns after the write."""
    from safetensors.torch import save_file

    state = {name: tensor.cpu() for name, tensor in export_weights(model, spec, coords, to_rank0=True)}

    def write() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for path in Path(source_dir).iterdir():
            if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(path, directory / path.name)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

    _write_on_rank0(write, directory)


def save_sequence_classifier(
    model: torch.nn.Module, spec: ModelSpec, coords: ParallelCoords, source_dir: Path, directory: Path
) -> None:
    """A reward model's stages as a HF sequence classifier (rltrain.backends.sequence_classifier):
    the trunk's full tensors and the last stage's bias-free head as `score.weight`, written by
    rank 0 (the tokenizer is the trainer's to add). Collective; every rank returns after the write."""
    from transformers import AutoConfig

    trunk = {name: tensor.cpu() for name, tensor in export_weights(model, spec, coords, to_rank0=True, output=False)}
    score_1H = _value_head_on_first_stage(model, spec, coords)
    _write_on_rank0(lambda: write_sequence_classifier(directory, AutoConfig.from_pretrained(source_dir), trunk, score_1H),
                    directory)


def _value_head_on_first_stage(model: torch.nn.Module, spec: ModelSpec, coords: ParallelCoords) -> torch.Tensor:
    """The value head's weight [1, H] (replicated over TP ranks), broadcast from the last pipeline
    stage to every stage. Collective over each pipeline group."""
    params = dict(model.named_parameters())
    if coords.pp == 1:
        return params[VALUE_HEAD_WEIGHT].detach().cpu()
    last = coords.pp_rank == coords.pp - 1
    first = next(iter(params.values()))
    head_1H = (
        params[VALUE_HEAD_WEIGHT].detach().clone()
        if last
        else torch.empty(1, spec.hidden_size, dtype=first.dtype, device=first.device)
    )
    dist.broadcast(head_1H, src=dist.get_process_group_ranks(coords.pp_group)[-1], group=coords.pp_group)
    return head_1H.cpu()


def _write_on_rank0(write: Callable[[], None], directory: Path) -> None:
    """Run `write` on global rank 0; every rank learns whether it worked (raises if not)."""
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, re-raised below
            error = exc
    flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32, device=control_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if int(flag) == 0:
        raise RuntimeError(f"rank 0 failed to write the Hugging Face directory {directory}")
