"""Ulysses attention: a sequence split over the cp ranks meets full-length attention over a slice of heads.

Every projection, MLP and norm is per token, so each cp rank runs them on its own tokens only; only
attention needs every token. One all-to-all per q, k and v trades "my tokens, all heads" for "all
tokens, my heads", sdpa runs there, and one all-to-all trades back. The mask is the whole row's,
handed in by the scorer (`CPAttention`), since the model sees only a slice and would build the
wrong one. docs/long-sequences.md has the limits (heads divisible by cp) and the costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ULYSSES_ATTENTION = "rltrain_ulysses"
# The keyword the scorer passes the model; transformers hands it on to every attention call.
CP_KWARG = "rltrain_cp"


@dataclass
class CPAttention:
    """One model call's attention over the whole (cp-padded) row: the cp group, its size, and the
    row's mask [B, 1, T, T] (True: attend) or None for plain causal attention."""

    group: dist.ProcessGroup
    size: int
    mask_B1TT: torch.Tensor | None


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """`x` split into `size` chunks along `scatter_dim`, chunk j sent to cp rank j; what rank i sends
    is concatenated along `gather_dim` in rank order."""
    sent = [c.contiguous() for c in torch.chunk(x, size, dim=scatter_dim)]
    received = [torch.empty_like(sent[0]) for _ in range(size)]
    dist.all_to_all(received, sent, group=group)
    return torch.cat(received, dim=gather_dim)


class _HeadsForTokens(torch.autograd.Function):
    """[B, h, T/cp, d] (all heads, my tokens) -> [B, h/cp, T, d] (my heads, all tokens); the
    backward is the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x_BhTd: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _all_to_all(x_BhTd, scatter_dim=1, gather_dim=2, group=group, size=size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_to_all(grad, scatter_dim=2, gather_dim=1, group=ctx.group, size=ctx.size), None, None


class _TokensForHeads(torch.autograd.Function):
    """The inverse of `_HeadsForTokens`: [B, h/cp, T, d] -> [B, h, T/cp, d]."""

    @staticmethod
    def forward(ctx: Any, x_BhTd: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _all_to_all(x_BhTd, scatter_dim=2, gather_dim=1, group=group, size=size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_to_all(grad, scatter_dim=1, gather_dim=2, group=ctx.group, size=ctx.size), None, None


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, heads, T/cp, d], key and value [B, kv heads,
    T/cp, d] of this rank's tokens; returns [B, T/cp, heads, d]. Key/value heads that cp does not
    divide are repeated to the query heads first (more traffic, the same numbers)."""
    spec: CPAttention | None = kwargs.get(CP_KWARG)
    if spec is None:
        raise RuntimeError(f"{ULYSSES_ATTENTION} attention called without `{CP_KWARG}`: only the cp scorer runs this model")
    if sliding_window is not None:
        raise RuntimeError("context parallelism does not support sliding-window attention layers")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % spec.size:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q = _HeadsForTokens.apply(query, spec.group, spec.size)
    k = _HeadsForTokens.apply(key, spec.group, spec.size)
    v = _HeadsForTokens.apply(value, spec.group, spec.size)
    # Grouped-query attention within this rank's heads: sdpa's own (no copies of key and value) on
    # plain causal rows, as transformers' sdpa does; repeated under a mask, where sdpa's GQA would
    # leave its memory-efficient kernel.
    gqa = k.shape[1] != q.shape[1]
    if gqa and spec.mask_B1TT is not None:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=spec.mask_B1TT, dropout_p=dropout, is_causal=spec.mask_B1TT is None, scale=scaling,
        enable_gqa=gqa and spec.mask_B1TT is None,
    )
    out = _TokensForHeads.apply(out, spec.group, spec.size)
    return out.transpose(1, 2).contiguous(), None


def switch_to_ulysses_attention(lm: PreTrainedModel, cp: int) -> None:
    """Run `lm` with `ulysses_attention` (registered in transformers' attention registry on first use;
    no mask function is registered, so the model builds no mask of its slice: the scorer hands the
    row's). A model class whose attention does not go through that registry, or whose heads cp does
    not divide, is refused (preflight checks what it can read before any rank starts)."""
    from transformers.modeling_utils import AttentionInterface

    from rltrain.runtime.errors import UserError

    if not type(lm)._supports_attention_backend:
        raise UserError(
            f"backend.cp={cp} with {type(lm).__name__}: its attention does not go through transformers' attention "
            "registry, so the split attention cannot be put in its place. Set backend.cp=1 for this model family."
        )
    heads = lm.config.get_text_config().num_attention_heads
    if heads % cp:
        raise UserError(
            f"backend.cp={cp} does not divide the model's {heads} attention heads: Ulysses attention gives each cp "
            f"rank an equal share of them. Choose a backend.cp that divides {heads}."
        )
    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    lm.set_attn_implementation(ULYSSES_ATTENTION)
