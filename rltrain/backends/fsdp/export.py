"""The FSDP engine's weights out: full Hugging Face tensors (weight sync) and model directories.

Each parameter is gathered from its shards on every rank (`full_parameter`, a collective), so
every rank must exhaust `hf_weights`. With LoRA the adapters are merged into the base, or saved as
a PEFT adapter directory (docs/lora.md). A reward model is written as a sequence classifier,
with LoRA its adapters merged; a vision-language one as its model directory plus the head's file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rltrain.backends.fsdp.groups import full_parameter
from rltrain.backends.sequence_classifier import (
    CRITIC_NOT_EXPORTED,
    write_score_head,
    write_sequence_classifier,
)
from rltrain.models import lora, moe
from rltrain.models.vision import is_vision_config

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def hf_weights(
    lm: PreTrainedModel, adapters: PeftModel | None, tied: bool, with_adapters: bool = True, as_checkpoint: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors under Hugging Face names, a tied output head left out; with LoRA, the adapters
    merged into the base (docs/lora.md, "Weight sync"). `with_adapters=False` leaves them out: the
    `adapter_dropped` fault (rltrain.safety.faults). A MoE model's experts under their checkpoint's
    per-expert names (rltrain.models.moe.checkpoint_weights), as vLLM loads them; `as_checkpoint=False`
    keeps the model's own names, for `save_pretrained`, which converts them itself."""
    weights: Iterator[tuple[str, torch.Tensor]]
    if adapters is not None:
        weights = lora.merged_weights(lm, full_parameter, with_adapters=with_adapters)
    else:
        weights = ((name, full_parameter(tensor).detach()) for name, tensor in lm.state_dict().items())
    if as_checkpoint and moe.is_moe(lm.config):
        weights = moe.checkpoint_weights(lm, weights)
    for name, tensor in weights:
        if tied and name == "lm_head.weight":
            continue
        yield name, tensor


def save_pretrained(
    directory: Path,
    lm: PreTrainedModel,
    adapters: PeftModel | None,
    save_merged: bool,
    tied: bool,
    model_dir: Path,
    rank: int,
    with_adapters: bool = True,
) -> None:
    """A Hugging Face model directory; with LoRA a PEFT adapter directory, plus the merged
    model in `merged/` when `model.lora.save_merged` (docs/lora.md, "Outputs"). Rank 0 writes."""
    if adapters is not None:
        adapter_state = lora.adapter_state(lm, full_parameter)  # collective
        if rank == 0:
            lora.save_adapter_dir(adapters, directory, adapter_state, model_dir)
        if not save_merged:
            return
        directory = directory / lora.MERGED_DIR
    state = dict(hf_weights(lm, adapters, tied, with_adapters, as_checkpoint=False))  # collective: every rank takes part
    if rank == 0:
        lm.save_pretrained(str(directory), state_dict=state, safe_serialization=True)


def save_sequence_classifier(
    directory: Path, lm: PreTrainedModel, adapters: PeftModel | None, value_head: torch.nn.Linear, rank: int, tied: bool
) -> None:
    """A value model as a Hugging Face sequence classifier (rltrain.backends.sequence_classifier);
    with LoRA, the adapters merged into the trunk (a plain classifier, no adapter directory). Only
    a reward model's head is bias-free; a critic's bias has no place in the classifier, so a
    critic is refused. A vision-language model, which has no classifier class, is written as its
    own model directory (merged) plus the head's file. Collective (every rank gathers); rank 0 writes."""
    if value_head.bias is not None:
        raise TypeError(f"save_pretrained: {CRITIC_NOT_EXPORTED}")
    if is_vision_config(lm.config):
        state = dict(hf_weights(lm, adapters, tied, as_checkpoint=False))  # collective
        head_1H = full_parameter(value_head.state_dict()["weight"]).detach()
        if rank == 0:
            lm.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
            write_score_head(directory, head_1H)
        return
    if adapters is not None:
        weights = lora.merged_weights(lm, full_parameter)
    else:
        weights = ((name, full_parameter(tensor).detach()) for name, tensor in lm.state_dict().items())
    trunk = dict(weights)
    score_1H = full_parameter(value_head.state_dict()["weight"]).detach()
    if rank == 0:
        write_sequence_classifier(directory, lm.config, trunk, score_1H)
