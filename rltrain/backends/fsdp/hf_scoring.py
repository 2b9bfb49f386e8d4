"""Scoring completion tokens with a Hugging Face causal LM: the module FSDP wraps as its root.

The output head runs only on positions that predict completion tokens, and a rank with no data
scores a dummy sequence so its collectives still happen; log-softmax and losses are always fp32.
docs/internals/backends.md describes the two heads and the precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from rltrain.backends.chunked_head import chunked_target_logps, use_chunked_head
from rltrain.backends.fsdp.context_parallel.sequence_split import AllPositions, Positions, SequenceSplit
from rltrain.backends.fsdp.micro_batches.attention_masks import model_attention_mask
from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle
from rltrain.backends.value_head import head_values
from rltrain.data.batch import SequenceBatch
from rltrain.data.ragged import Ragged
from rltrain.models import moe
from rltrain.models.vision import grid_model_inputs, places_by_grid, vision_modules

# What one more model call costs, in tokens of compute, when splitting a micro-batch into length
# buckets: on CPU a call is cheap next to its matmuls; on an accelerator small calls are
# launch-bound, so fewer, larger rectangles win.
BUCKET_COST_TOKENS = {"cpu": 32, "cuda": 4096}


class _SelectedHidden(nn.Module):
    """Wraps a causal LM's transformer: its final hidden states at the selected positions (those
    that predict the scored completion tokens), however the micro-batch is laid out (one plain
    rectangle, length buckets, packed rows that share a prompt, or one padding-free row). The heads
    are the subclasses'. `flex_attention`: the model runs flex_attention, so masks are handed to it
    as BlockMasks (rltrain.backends.fsdp.micro_batches.attention_masks)."""

    def __init__(
        self,
        lm: nn.Module,
        moe_info: moe.MoEInfo | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        flex_attention: bool = False,
    ) -> None:
        super().__init__()
        self.lm = lm
        self.moe_info = moe_info
        self.autocast = autocast  # entered around the model and the head (see the module docstring)
        self.flex_attention = flex_attention
        # A vision-language model's tower and projector (a plain list: not registered twice).
        self.vision_parts: list[nn.Module] = vision_modules(lm)
        # backend.cp > 1: each rank runs its slice of every row (set by the engine once its groups exist)
        self.split: SequenceSplit | None = None

    def _router(self) -> bool:
        """Whether this pass reads the router logits: training a MoE model (its router losses and
        load metric, rltrain.models.moe.router_terms)."""
        return self.training and self.moe_info is not None

    def selected_hidden(
        self, rects: Sequence[Rectangle], order_N: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None, AllPositions | Positions]:
        """(hidden states [N, H] in ragged order, the router logits of a MoE model or None, positions).
        Call inside `self.autocast()`. One model call per rectangle (several: length buckets or packed
        rows, see `rltrain.backends.fsdp.micro_batches.layout`); the selected hidden states are concatenated in rectangle
        order and `order_N` puts them back into ragged order. `positions` maps per-position tensors
        between the hidden states' rows and the ragged [N]: the identity, except under context
        parallelism, where the hidden states are this rank's positions only (`_split_hidden`)."""
        if self.split is not None:
            return self._split_hidden(rects, order_N)
        # A plain rectangle is right-padded: causal attention never lets a real token see the
        # padding after it, so it needs no attention mask (and sdpa keeps its fast causal path).
        router = self._router()
        assert not (router and len(rects) > 1), "a MoE's router terms need one plain rectangle"
        parts, router_logits = [], None
        for rect in rects:
            kwargs = {}
            if (mask := model_attention_mask(rect, self.flex_attention)) is not None:
                kwargs["attention_mask"] = mask
            if rect.position_ids_BT is not None:
                kwargs["position_ids"] = rect.position_ids_BT
            if router:
                kwargs["output_router_logits"] = True
            # The decoder stack: torch types a submodule attribute as `Tensor | Module`.
            inner = cast(nn.Module, self.lm.model)
            images = rect.model_inputs or {}
            if places_by_grid(images):  # the prompts' image slots only (rltrain.models.vision)
                kwargs.update(grid_model_inputs(inner, rect.input_ids_BT, images))
                out = inner(use_cache=False, **kwargs)
            else:
                out = inner(input_ids=rect.input_ids_BT, use_cache=False, **kwargs, **images)
            parts.append(out.last_hidden_state[rect.rows_N, rect.cols_N])
            if router:
                router_logits = out.router_logits
        hidden_NH = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order_N is not None:
            hidden_NH = hidden_NH[order_N]
        return self._reach_vision(hidden_NH), router_logits, AllPositions()

    def _split_hidden(
        self, rects: Sequence[Rectangle], order_N: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, Positions]:
        """`selected_hidden` under context parallelism: sharded ranks make one call per micro-batch
        (one rectangle); a MoE or an image row is refused before a run starts."""
        assert self.split is not None and len(rects) == 1, "context parallelism scores one rectangle per call"
        hidden_nH, positions = self.split.hidden(cast(nn.Module, self.lm.model), rects[0], order_N)
        return hidden_nH, None, positions

    def _reach_vision(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """With a trainable vision tower, every training pass gives each of its parameters a
        gradient (zero where no row had an image): FSDP reduce-scatters the parameters that have
        gradients, and ranks whose micro-batches differ in having images must still agree on them."""
        if not self.training:
            return hidden_NH
        params = [p for part in self.vision_parts for p in part.parameters() if p.requires_grad]
        if not params:
            return hidden_NH
        return hidden_NH + 0.0 * torch.stack([p.sum() for p in params]).sum().to(hidden_NH.dtype)

    def _router_terms(
        self, router_logits: tuple[torch.Tensor, ...] | None, padding_mask_BT: torch.Tensor | None
    ) -> moe.RouterTerms | None:
        if router_logits is None:
            return None
        assert self.moe_info is not None  # router logits are requested only for a MoE model
        return moe.router_terms(self.lm, self.moe_info, router_logits, padding_mask_BT)


class CompletionScorer(_SelectedHidden):
    """Log-probabilities (and entropies) of the scored tokens through the LM's output head."""

    def forward(
        self,
        rects: Sequence[Rectangle],
        targets_N: torch.Tensor,
        with_entropy: bool = False,
        order_N: torch.Tensor | None = None,
        padding_mask_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, moe.RouterTerms | None]:
        """(logps [N], entropy [N] or None, a MoE's router terms in a training pass, else None).
        `padding_mask_BT` marks real tokens of a single plain rectangle, for the router terms."""
        with self.autocast():
            hidden_NH, router_logits, positions = self.selected_hidden(rects, order_N)
            targets_N = positions.local(targets_N)  # this rank's under context parallelism
            head = cast(nn.Linear, self.lm.lm_head)  # a submodule attribute (torch: `Tensor | Module`)
            chunked = use_chunked_head(hidden_NH.shape[0], head)
            if chunked:  # large vocabulary: logits exist one chunk at a time (chunked_head)
                logps_N, entropy_N = chunked_target_logps(hidden_NH, head.weight, targets_N, with_entropy)
            else:
                logits_NV = head(hidden_NH)
        router = self._router_terms(router_logits, padding_mask_BT)
        if chunked:
            return positions.gather(logps_N), positions.gather(entropy_N) if entropy_N is not None else None, router
        logits_NV = logits_NV.float()  # fp32 from here on, whatever the compute dtype
        logp_NV = torch.log_softmax(logits_NV, dim=-1)
        # clone: FSDP warns (rightly) about returning views from a wrapped module
        logps_N = logp_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1).clone()
        entropy_N = None
        if with_entropy:  # a metric, never differentiated: no graph for it in a training pass
            with torch.no_grad():
                entropy_N = positions.gather(-(logp_NV.exp() * logp_NV).sum(-1))
        return positions.gather(logps_N), entropy_N, router


class CompletionValuer(_SelectedHidden):
    """A critic: values of the scored positions through a scalar value head
    (rltrain.backends.value_head). The LM's output head is dropped (set to None) so that it is
    neither trained nor kept in memory; with tied embeddings its weight is the input embedding,
    which stays."""

    def __init__(
        self,
        lm: nn.Module,
        value_head: nn.Linear,
        moe_info: moe.MoEInfo | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        flex_attention: bool = False,
    ) -> None:
        super().__init__(lm, moe_info, autocast, flex_attention)
        lm.lm_head = None  # type: ignore[assignment]  # torch's stub omits None, which unregisters a submodule
        self.value_head = value_head

    def forward(
        self,
        rects: Sequence[Rectangle],
        targets_N: torch.Tensor,
        with_entropy: bool = False,
        order_N: torch.Tensor | None = None,
        padding_mask_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None, moe.RouterTerms | None]:
        """(values [N] in fp32, None, a MoE's router terms or None): `CompletionScorer`'s signature, so
        the engine drives both alike; the targets are not needed and there is no entropy."""
        if with_entropy:
            raise ValueError("a critic has no entropy: with_entropy=True is for policy engines")
        with self.autocast():
            hidden_NH, router_logits, positions = self.selected_hidden(rects, order_N)
        values_N = positions.gather(head_values(self.value_head, hidden_NH))
        return values_N, None, self._router_terms(router_logits, padding_mask_BT)


def completion_positions(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows_N, cols_N, targets_N): for every completion token, the position whose logits predict
    it and the token itself, in ragged (sequence-major) order. Vectorised (no per-sequence loop):
    a GRPO micro-batch holds hundreds of short sequences."""
    comp_lens_B = batch.completion_lens()
    n = int(comp_lens_B.sum()) if len(batch) else 0
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty
    comp_starts_B = torch.cumsum(comp_lens_B, 0) - comp_lens_B
    j_N = torch.arange(n) - torch.repeat_interleave(comp_starts_B, comp_lens_B)  # index within its completion
    rows_N = torch.repeat_interleave(torch.arange(len(batch)), comp_lens_B)
    cols_N = torch.repeat_interleave(batch.prompt_lens - 1, comp_lens_B) + j_N
    starts_B = batch.tokens.offsets[:-1] + batch.prompt_lens  # first completion token of each sequence
    targets_N = batch.tokens.values[torch.repeat_interleave(starts_B, comp_lens_B) + j_N]
    return rows_N, cols_N, targets_N


def bucket_rectangles(batch: SequenceBatch, groups: list[list[int]], pad_id: int) -> tuple[list[Rectangle], torch.Tensor]:
    """Length buckets of one micro-batch: one rectangle per group of sequence indices, and the permutation `order_N` that takes the groups'
    concatenated completion positions back to ragged order."""
    comp_offsets = torch.zeros(len(batch) + 1, dtype=torch.long)
    comp_offsets[1:] = torch.cumsum(batch.completion_lens(), 0)
    seqs = batch.tokens.split()
    rects, dest = [], []
    for group in groups:
        sub = SequenceBatch(Ragged.from_list([seqs[i] for i in group]), batch.prompt_lens[group])
        ids_BT, _ = sub.tokens.to_padded(pad_id)
        rows, cols, _ = completion_positions(sub)
        rects.append(Rectangle(ids_BT, rows, cols))
        dest += [torch.arange(int(comp_offsets[i]), int(comp_offsets[i + 1])) for i in group]
    dest_N = torch.cat(dest)
    order_N = torch.empty_like(dest_N)
    order_N[dest_N] = torch.arange(dest_N.numel())
    return rects, order_N


def dummy_batch(pad_id: int) -> SequenceBatch:
    """A two-token sequence for ranks with no data in a micro-batch: its forward keeps every
    collective in step, and its output anchors a zero loss to every parameter."""
    return SequenceBatch.from_lists([[pad_id]], [[pad_id]])
