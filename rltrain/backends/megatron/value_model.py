"""A megatron-core GPTModel stage as a value model (a critic, a reward model): final hidden states
through a scalar value head.

Only the last stage changes: its output layer is dropped and a replicated `Linear(hidden, 1)`
registered on it, so checkpoints, offloading and gradient reductions see it like any parameter.
docs/internals/backends.md explains tensor and pipeline parallelism for the head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rltrain.backends.megatron.convert import VALUE_HEAD_BIAS, VALUE_HEAD_WEIGHT
from rltrain.backends.value_head import initial_value_head

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def make_value_stage(model: GPTModel, hidden_size: int, dtype: torch.dtype, bias: bool = True) -> None:
    """Turn a last-stage GPTModel (built untied) into a critic stage, in place. The head's weights
    are loaded with the stage's (`value_head_shards`). `bias=False`: a reward model's head, like a
    Hugging Face sequence classifier's score layer (rltrain.backends.sequence_classifier)."""
    if model.share_embeddings_and_output_weights:
        raise ValueError("a critic stage is built with untied embeddings (it has no output layer to tie)")
    del model.output_layer
    model.post_process = False
    device = next(model.parameters()).device
    model.value_head = torch.nn.Linear(hidden_size, 1, bias=bias, dtype=dtype, device=device)


def value_head_shards(hidden_size: int, seed: int, bias: bool = True) -> dict[str, torch.Tensor]:
    """The head's initial weights under its stage parameter names (identical on every rank)."""
    initial = initial_value_head(hidden_size, seed)
    shards = {VALUE_HEAD_WEIGHT: initial["weight"]}
    return shards | {VALUE_HEAD_BIAS: initial["bias"]} if bias else shards
