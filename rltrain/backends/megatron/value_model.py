"""A megatron-core GPTModel stage as a critic: final hidden states through a scalar value head.

Only the last pipeline stage changes. Its vocab-parallel output layer is dropped (never loaded,
trained or kept), and `post_process` is switched off after construction, so the GPTModel returns
the decoder's output, [T, B, H] after the final layernorm (the decoder was built with it), instead
of logits. The engine applies `value_head`, a `Linear(hidden, 1)` registered on the stage so that
checkpoints, offloading, the optimizer and gradient reductions see it like any other parameter.

Tensor parallelism: sequence parallelism is off (`model.transformer_config`), so every TP rank
holds the full, identical hidden states. The head is replicated: each TP rank computes the same
values and the same loss, and gets the same head gradient and the full gradient of the hidden
states, which it back-propagates into its own shards (the last row-parallel layer's reduction has
an identity backward). Nothing needs reducing across TP; the head counts once in the global norm
(`convert.split_dim` calls it replicated). Pipeline: the critic's model is built untied (no
embedding copy on the last stage), whatever the checkpoint's `tie_word_embeddings`.
"""

from __future__ import annotations

import torch

from rltrain.backends.megatron.convert import VALUE_HEAD_BIAS, VALUE_HEAD_WEIGHT
from rltrain.backends.value_head import initial_value_head


def make_value_stage(model: torch.nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
    """Turn a last-stage GPTModel (built untied) into a critic stage, in place. The head's weights
    are loaded with the stage's (`value_head_shards`)."""
    if model.share_embeddings_and_output_weights:
        raise ValueError("a critic stage is built with untied embeddings (it has no output layer to tie)")
    del model.output_layer
    model.post_process = False
    device = next(model.parameters()).device
    model.value_head = torch.nn.Linear(hidden_size, 1, dtype=dtype, device=device)


def value_head_shards(hidden_size: int, seed: int) -> dict[str, torch.Tensor]:
    """The head's initial weights under its stage parameter names (identical on every rank)."""
    initial = initial_value_head(hidden_size, seed)
    return {VALUE_HEAD_WEIGHT: initial["weight"], VALUE_HEAD_BIAS: initial["bias"]}
