"""transformers' flex_attention with query, key and value cast to autocast's dtype first.

Under autocast one unsharded `bf16-mixed` rank hands attention fp32 query/key and a bf16 value;
sdpa casts them, flex_attention does not in every torch, so this makes flex compute what sdpa
computes. docs/internals/backends.md has the details.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.integrations.flex_attention import flex_attention_forward

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


def switch_to_flex_attention(lm: PreTrainedModel) -> None:
    """Run `lm` with `autocast_flex_attention` (registered in transformers' attention and mask
    registries on first use; registering again replaces the entry with the same function)."""
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(AUTOCAST_FLEX_ATTENTION, autocast_flex_attention)
    AttentionMaskInterface.register(AUTOCAST_FLEX_ATTENTION, flex_attention_mask)
    lm.set_attn_implementation(AUTOCAST_FLEX_ATTENTION)
