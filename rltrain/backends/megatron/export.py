"""Stream full Hugging Face tensors out of a tp x pp sharded model; write a HF directory.

Every rank knows every shard shape from the config, so tensors are exchanged with no metadata on
the wire, to every rank (weight sync) or to rank 0 (saving). The generator issues collectives:
every rank must exhaust it. docs/internals/backends.md describes both modes.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rltrain.backends.megatron.convert import megatron_shape, megatron_to_hf, split_dim, stage_param_names
from rltrain.backends.megatron.groups import Layout
from rltrain.backends.megatron.spec import ModelSpec
from rltrain.runtime import distributed as p2p
from rltrain.runtime.distributed import control_device

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _owner_items(
    params: dict[str, torch.nn.Parameter], spec: ModelSpec, name: str, layout: Layout, offset: int
) -> list[tuple[str, torch.Tensor]]:
    local = params[name].detach()
    if split_dim(name) is None or layout.tp == 1:
        shards = [local]
    else:
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(layout.tp)]
        dist.all_gather(shards, local, group=layout.tp_group)
    return [(n, t.clone(memory_format=torch.contiguous_format)) for n, t in megatron_to_hf(spec, name, shards, offset)]


def _remote_items(
    spec: ModelSpec, name: str, layout: Layout, offset: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    meta = [torch.empty(megatron_shape(spec, name, layout.tp), dtype=dtype, device="meta")] * layout.tp
    return [(n, torch.empty(t.shape, dtype=dtype, device=device)) for n, t in megatron_to_hf(spec, name, meta, offset)]


def export_weights(
    model: torch.nn.Module, spec: ModelSpec, layout: Layout, to_rank0: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    params = dict(model.named_parameters())
    first = next(iter(params.values()))
    dtype, device = first.dtype, first.device
    if to_rank0 and layout.dp_rank != 0:
        return
    pp_ranks = dist.get_process_group_ranks(layout.pp_group) if layout.pp > 1 else [dist.get_rank()]
    me = dist.get_rank()
    for stage in range(layout.pp):
        offset = spec.stage_layers(stage, layout.pp).start
        owner = stage == layout.pp_rank
        for name in stage_param_names(spec, stage, layout.pp):
            if owner:
                items = _owner_items(params, spec, name, layout, offset)
            elif not to_rank0:
                items = _remote_items(spec, name, layout, offset, dtype, device)
            elif me == 0:
                items = _remote_items(spec, name, layout, offset, dtype, device)
            else:
                continue
            for hf_name, tensor in items:
                if layout.pp > 1 and not to_rank0:
                    dist.broadcast(tensor, src=pp_ranks[stage], group=layout.pp_group)
                elif layout.pp > 1 and stage != 0 and layout.tp_rank == 0:
                    if owner:
                        p2p.isend(tensor, dst=pp_ranks[0], group=layout.pp_group).wait()
                    elif layout.pp_rank == 0:
                        p2p.recv(tensor, src=pp_ranks[stage], group=layout.pp_group)
                if not to_rank0 or me == 0:
                    yield hf_name, tensor


def save_pretrained(
    model: torch.nn.Module, spec: ModelSpec, layout: Layout, source_dir: Path, directory: Path
) -> None:
    """Write a HF model directory (rank 0): config and tokenizer files copied from the source
    directory, weights as one safetensors file. Collective; every rank returns after the write."""
    from safetensors.torch import save_file

    state = {name: tensor.cpu() for name, tensor in export_weights(model, spec, layout, to_rank0=True)}
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for path in Path(source_dir).iterdir():
                if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(path, directory / path.name)
            save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, re-raised below
            error = exc
    flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32, device=control_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if int(flag) == 0:
        raise RuntimeError(f"rank 0 failed to write the Hugging Face directory {directory}")
