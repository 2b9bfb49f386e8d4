"""This rank's share of a MegatronEngine, in the order the engine builds it: the process groups it
joins, its precision, its pipeline stage (a value model's with its value head) and the Hugging Face
weights loaded into it. The engine (engine.py) holds the result; docs/internals/backends.md.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from rltrain.backends.megatron.convert import hf_to_megatron
from rltrain.backends.megatron.groups import ParallelCoords, ParallelGroups
from rltrain.backends.megatron.hf_source import hf_reader
from rltrain.backends.megatron.model import build_stage, checkpoint_layers, load_stage_weights
from rltrain.backends.megatron.spec import ModelSpec
from rltrain.backends.megatron.value_model import make_value_stage, value_head_shards
from rltrain.config.run_context import SharedObjects
from rltrain.runtime.precision import Precision, resolve_precision


def engine_precision(precision: Precision | str, device: torch.device | None) -> Precision:
    """`precision` as given, or resolved for `device` (else CUDA when there is one, else the CPU)."""
    if isinstance(precision, Precision):
        return precision
    default = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_precision(precision, device if device is not None else default)


def join_groups(
    groups: ParallelGroups | None, shared: SharedObjects | None, tp: int, pp: int, timeout_s: float | None,
    ep: int = 1,
) -> ParallelGroups:
    """`groups`, else the ones `shared` holds (the first engine creates them), else new ones; they
    must have the engine's tp, pp and ep."""
    create = partial(ParallelGroups.created, tp, pp, timeout_s=timeout_s, ep=ep)
    if groups is None:
        groups = create() if shared is None else shared.one(ParallelGroups, create)
    if (groups.tp, groups.pp, groups.ep) != (tp, pp, ep):
        raise ValueError(
            f"the given ParallelGroups are tp={groups.tp}, pp={groups.pp}, ep={groups.ep}; this engine needs "
            f"tp={tp}, pp={pp}, ep={ep}"
        )
    return groups


def built_stage(
    build_spec: ModelSpec, coords: ParallelCoords, precision: Precision, *, value_model: bool,
    device: torch.device | None, gradient_checkpointing: bool, value_head_bias: bool,
) -> Any:  # megatron's GPTModel (rltrain.backends.megatron.model.build_stage)
    """This rank's pipeline stage of tp shards, uninitialised; a value model's last stage with its
    value head in place of the output layer."""
    model = build_stage(build_spec, coords.tp, coords.pp, coords.pp_rank, precision.param_dtype, coords.ep)
    if value_model and coords.pp_rank == coords.pp - 1:
        make_value_stage(model, build_spec.hidden_size, precision.param_dtype, value_head_bias)
    if device is not None:
        model.to(device)
    if gradient_checkpointing:
        checkpoint_layers(model)
    return model


def load_hf_weights(
    model: Any, spec: ModelSpec, model_dir: Path, coords: ParallelCoords, value_head_seed: int | None,
    value_head_bias: bool,
) -> None:
    """The stage's shards of the Hugging Face weights; a value model's head drawn from its seed."""
    critic = value_head_seed is not None
    shards = hf_to_megatron(
        spec, hf_reader(model_dir), coords.tp_rank, coords.tp, coords.pp_rank, coords.pp, output=not critic,
        ep_rank=coords.ep_rank, ep=coords.ep,
    )
    if value_head_seed is not None and coords.pp_rank == coords.pp - 1:
        shards |= value_head_shards(spec.hidden_size, value_head_seed, value_head_bias)
    load_stage_weights(model, shards)
