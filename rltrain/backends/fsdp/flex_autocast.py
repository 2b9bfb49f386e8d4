"""The attention a padding-free FSDP engine switches its model to on CUDA: transformers'
flex_attention, with query, key and value first cast to autocast's dtype when autocast is on.

Why: one unsharded rank in `bf16-mixed` runs fp32 weights under autocast, so the residual stream
stays fp32. The rotary embedding is computed in the hidden states' dtype (fp32) and multiplies the
bf16 query and key projections back into fp32, while the value projection stays bf16: the
attention receives fp32 query and key with a bf16 value. sdpa is on autocast's list and casts all
three to bf16. flex_attention is not on it in every torch: depending on the version it refuses mixed
dtypes ("Expected query, key, and value to have the same dtype"), or upcasts key and value to the
query's dtype and runs the whole attention in fp32, slower than the sdpa path and not what it
computes. Casting here, as autocast does for sdpa, makes flex compute what sdpa computes on every
torch; without autocast (fp32, pure bf16, sharded ranks whose FSDP casts the weights) nothing
changes.

The function is registered in transformers' attention registry under its own name, with the
flex_attention mask builder for calls that pass no mask, so other models in the process keep
transformers' own flex_attention.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.flex_attention import flex_attention_forward

AUTOCAST_FLEX_ATTENTION = "rltrain_flex_attention"


def autocast_flex_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' `flex_attention_forward`, on query, key and value in autocast's dtype when
    autocast is on for their device (see the module docstring)."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def switch_to_flex_attention(lm: nn.Module) -> None:
    """Run `lm` with `autocast_flex_attention` (registered in transformers' attention and mask
    registries on first use; registering again replaces the entry with the same function)."""
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(AUTOCAST_FLEX_ATTENTION, autocast_flex_attention)
    AttentionMaskInterface.register(AUTOCAST_FLEX_ATTENTION, flex_attention_mask)
    lm.set_attn_implementation(AUTOCAST_FLEX_ATTENTION)
