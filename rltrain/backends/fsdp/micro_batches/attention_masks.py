"""The attention mask a `Rectangle` hands the model, in the form the model's attention takes.

sdpa (every device) takes a dense 4D boolean mask; flex_attention (CUDA, padding-free packing)
takes a block-sparse `BlockMask`, so a packed row never builds a T x T tensor.
docs/internals/backends.md describes the masks of each row kind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def document_causal_mask(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean: query q attends to key k iff k <= q and both are in one document."""
    width = document_ids_BT.shape[1]
    causal_TT = torch.ones(width, width, dtype=torch.bool, device=document_ids_BT.device).tril()
    same_BTT = document_ids_BT[:, :, None] == document_ids_BT[:, None, :]
    return (causal_TT & same_BTT)[:, None]


def document_causal_mask_mod(document_ids_BT: torch.Tensor) -> MaskMod:
    """`document_causal_mask` as a flex_attention `mask_mod` (evaluated per block, never as a square)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (document_ids_BT[b, q] == document_ids_BT[b, kv])

    return mask_mod


def dense_mask_mod(mask_B1TT: torch.Tensor) -> MaskMod:
    """A dense boolean mask (a shared-prompt row's) as a flex_attention `mask_mod`, by lookup."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return mask_B1TT[b, 0, q, kv]

    return mask_mod


def block_mask(mask_mod: MaskMod, rows: int, width: int, device: torch.device):
    """The `BlockMask` of `mask_mod` over `rows` rows of `width` tokens, one for every head. On
    CUDA its construction is compiled (`compiled_create_block_mask`), so it is computed block by
    block; on CPU (the tests) it is evaluated eagerly."""
    from torch.nn.attention.flex_attention import create_block_mask

    build = compiled_create_block_mask() if device.type == "cuda" else create_block_mask
    return build(mask_mod, B=rows, H=None, Q_LEN=width, KV_LEN=width, device=device)


@functools.cache
def compiled_create_block_mask():
    """`torch.compile(create_block_mask)`, made once (torch's recommended form; its `_compile=True`
    flag is deprecated)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def use_flex_attention(lm: nn.Module, device: torch.device) -> bool:
    """Whether a padding-free engine runs `lm` with flex_attention: only on CUDA (flex_attention has
    no backward on CPU), with a torch that has it, for a model class transformers supports it on."""
    if device.type != "cuda":
        return False
    from transformers.utils import is_torch_flex_attn_available

    return is_torch_flex_attn_available() and bool(lm._supports_flex_attn)


def model_attention_mask(rect: Rectangle, flex: bool):
    """The `attention_mask` argument for one model call on `rect` (already on its device): a
    boolean [B, 1, T, T] tensor for sdpa, a `BlockMask` for flex_attention, or None (plain causal,
    built by the model)."""
    rows, width = rect.input_ids_BT.shape
    device = rect.input_ids_BT.device
    if rect.document_ids_BT is not None:
        if flex:
            return block_mask(document_causal_mask_mod(rect.document_ids_BT), rows, width, device)
        return document_causal_mask(rect.document_ids_BT)
    if rect.attention_mask_B1TT is not None and flex:
        return block_mask(dense_mask_mod(rect.attention_mask_B1TT), rows, width, device)
    return rect.attention_mask_B1TT
