"""Placing the FSDP engine's model on its ranks, so that no rank but 0 ever holds all of it.

The model comes built on the meta device; `fully_shard` wraps each decoder layer and then the
scorer over the engine's own group, each rank allocates only its shards, and rank 0 reads the
checkpoint and scatters every rank its rows. docs/internals/backends.md ("Start-up") and
docs/internals/models.md tell the story.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rltrain.backends.fsdp.groups import FSDPGroups
from rltrain.backends.fsdp.hf_scoring import CompletionScorer, CompletionValuer
from rltrain.backends.value_head import fill_value_head
from rltrain.config.group_options import FSDPBackendConfig
from rltrain.models import lora
from rltrain.models.hf_io import load_sharded_weights
from rltrain.models.vision import decoder_layers
from rltrain.runtime.precision import Precision

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def shard_model(
    lm: PreTrainedModel,
    scorer: CompletionScorer | CompletionValuer,
    groups: FSDPGroups,
    precision: Precision,
    cfg: FSDPBackendConfig,
) -> None:
    """`fully_shard` each decoder layer, then the scorer (the root unit), over `groups`; gradients
    are summed across ranks, not averaged (losses are globally normalised)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = groups.mesh  # our own group, not WORLD: time sharing tears it down (fsdp_groups)
    mp = MixedPrecisionPolicy()  # compute in the weights' dtype (fp32, or bf16 in pure bf16)
    if precision.mixed:
        mp = MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(lm):
        fully_shard(layer, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp)
    fully_shard(scorer, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp)
    groups.attach(scorer)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def load_shards(
    lm: PreTrainedModel,
    scorer: CompletionScorer | CompletionValuer,
    groups: FSDPGroups,
    model_dir: Path,
    precision: Precision,
    device: torch.device,
    adapters: PeftModel | None,
    seed: int,
    value_head_seed: int | None,
) -> None:
    """Allocate this rank's shards of the sharded model and fill them: the base from `model_dir`,
    LoRA adapters (drawn from `seed`) and a critic's value head from their seeded draws. Collective."""
    scorer.to_empty(device=device)  # this rank's shards (and buffers), uninitialised
    if adapters is None:
        load_sharded_weights(lm, model_dir, precision.param_dtype, groups.group)
    else:
        load_sharded_weights(lm, model_dir, precision.param_dtype, groups.group, source_name=lora.source_name)
        lora.fill_adapters(lm, seed, groups.group, sharded=True)
    if isinstance(scorer, CompletionValuer):  # its rows from the seeded draw
        assert value_head_seed is not None
        fill_value_head(scorer.value_head, value_head_seed, precision.param_dtype, groups.group)
