"""A reward model's `final/`: a Hugging Face one-output sequence classifier, from either backend.

Both training backends export a reward model (a value model with a bias-free head) the same way:
the trunk's weights under their Hugging Face names (`model.*`, which `<Arch>ForCausalLM` and
`<Arch>ForSequenceClassification` share) and the head as the classifier's bias-free `score`
layer, so `reward_model=hf` loads it as is. docs/algorithms.md, "Reward model".

A vision-language model has no such classifier in transformers, so its reward model is the model
directory as every vision-language `final/` is (AutoModelForImageTextToText) plus the head in
`score.safetensors`, named by config.json's `rltrain_reward_head` (docs/vision.md, "The reward model").
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SCORE_WEIGHT = "score.weight"  # the classifier's head, [1, hidden]
LM_HEAD_WEIGHT = "lm_head.weight"  # a causal LM's output layer: no place in a classifier
# A vision-language reward model: the head's file beside the model, and the config.json key naming it.
SCORE_HEAD_FILE = "score.safetensors"
REWARD_HEAD_KEY = "rltrain_reward_head"

CRITIC_NOT_EXPORTED = (
    "a critic is not exported: its value head has a bias, which a Hugging Face sequence classifier's score layer "
    "lacks; its weights and optimizer live in the run's checkpoints"
)


def sequence_classifier_config(lm_config: PretrainedConfig) -> PretrainedConfig:
    """The causal LM's config as a one-output sequence classifier's (`<Arch>ForSequenceClassification`,
    `num_labels=1`): what `AutoModelForSequenceClassification` and `reward_model=hf` load."""
    config = copy.deepcopy(lm_config)
    config.architectures = [
        name.replace("ForCausalLM", "ForSequenceClassification") for name in (lm_config.architectures or [])
    ] or [f"{type(lm_config).__name__.removesuffix('Config')}ForSequenceClassification"]
    config.num_labels = 1
    return config


def write_sequence_classifier(
    directory: Path, lm_config: PretrainedConfig, trunk: dict[str, torch.Tensor], score_1H: torch.Tensor
) -> None:
    """Write `directory` (config.json, model.safetensors) from the trunk's full tensors under HF
    names (an LM head among them is left out) and the head's weight [1, H]. One process writes."""
    from safetensors.torch import save_file

    tensors = {name: t.to("cpu").contiguous() for name, t in trunk.items() if name != LM_HEAD_WEIGHT}
    tensors[SCORE_WEIGHT] = score_1H.detach().to("cpu").contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    sequence_classifier_config(lm_config).save_pretrained(str(directory))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_score_head(directory: Path, score_1H: torch.Tensor) -> None:
    """Add a reward head to a vision-language model directory written beside it: `score.safetensors`
    (`score.weight`, [1, H]) and config.json's `rltrain_reward_head` naming it. One process writes."""
    from safetensors.torch import save_file

    save_file({SCORE_WEIGHT: score_1H.detach().to("cpu").contiguous()}, str(directory / SCORE_HEAD_FILE), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config[REWARD_HEAD_KEY] = SCORE_HEAD_FILE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_vision_reward_config(config: dict) -> bool:
    """Whether a config.json's dict is a vision-language reward model's (`write_score_head`)."""
    return "vision_config" in config and config.get(REWARD_HEAD_KEY) == SCORE_HEAD_FILE


def read_score_head(directory: Path) -> torch.Tensor:
    """A vision-language reward model's head weight [1, H], in fp32 (values are always fp32)."""
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / SCORE_HEAD_FILE))[SCORE_WEIGHT].float()
