"""The FSDP engine's weights out: full Hugging Face tensors (weight sync) and model directories.

Each parameter is gathered from its shards on every rank (`full_parameter`, a collective), so
every rank must exhaust `hf_weights`. With LoRA the adapters are merged into the base, or saved as
a PEFT adapter directory (docs/lora.md). A reward model is written as a sequence classifier.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from rltrain.backends.fsdp.groups import full_parameter
from rltrain.models import lora
from rltrain.safety import faults

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel


def hf_weights(lm: PreTrainedModel, adapters: PeftModel | None, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors under Hugging Face names, a tied output head left out; with LoRA, the adapters
    merged into the base (docs/lora.md, "Weight sync")."""
    if adapters is not None:
        weights = lora.merged_weights(lm, full_parameter, with_adapters=not faults.active().adapters_dropped())
    else:
        weights = ((name, full_parameter(tensor).detach()) for name, tensor in lm.state_dict().items())
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
    state = dict(hf_weights(lm, adapters, tied))  # collective: every rank takes part
    if rank == 0:
        lm.save_pretrained(str(directory), state_dict=state, safe_serialization=True)


def sequence_classifier_config(lm_config: PretrainedConfig) -> PretrainedConfig:
    """The causal LM's config as a one-output sequence classifier's (`<Arch>ForSequenceClassification`,
    `num_labels=1`): what `AutoModelForSequenceClassification` and `reward_model=hf` load."""
    config = copy.deepcopy(lm_config)
    config.architectures = [
        name.replace("ForCausalLM", "ForSequenceClassification") for name in (lm_config.architectures or [])
    ] or [f"{type(lm_config).__name__.removesuffix('Config')}ForSequenceClassification"]
    config.num_labels = 1
    return config


def save_sequence_classifier(directory: Path, lm: PreTrainedModel, value_head: torch.nn.Linear, rank: int) -> None:
    """A value model as a Hugging Face sequence classifier: the trunk's weights under their names
    (`model.*`, shared by `<Arch>ForCausalLM` and `<Arch>ForSequenceClassification`) and the head
    as its bias-free `score` layer. Only a reward model's head is bias-free; a critic's bias has no
    place there, so a critic is refused. Collective (every rank gathers); rank 0 writes."""
    if value_head.bias is not None:
        raise TypeError(
            "save_pretrained: a critic is not exported: its value head has a bias, which a Hugging Face sequence "
            "classifier's score layer lacks; its weights and optimizer live in the run's checkpoints"
        )
    state = {name: full_parameter(tensor).detach() for name, tensor in lm.state_dict().items() if name != "lm_head.weight"}
    state["score.weight"] = full_parameter(value_head.state_dict()["weight"]).detach()
    if rank != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    sequence_classifier_config(lm.config).save_pretrained(str(directory))
    tensors = {name: tensor.to("cpu").contiguous() for name, tensor in state.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
