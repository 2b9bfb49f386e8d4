"""Scoring sequences that share a prompt with the prompt computed once (one packed row per prompt).

GRPO groups and DPO pairs would otherwise run the model over each prompt once per completion; the
packed row gives the unpacked log-probabilities to fp32 round-off. docs/internals/backends.md has
the layout rules and how `PackingCost` decides when packing pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.backends.fsdp.micro_batches.widths import packed_width
from rltrain.data.batch import SequenceBatch, length_buckets


@dataclass
class Rectangle:
    """One model call: right-padded rows, and which positions predict the scored tokens."""

    input_ids_BT: torch.Tensor
    rows_N: torch.Tensor
    cols_N: torch.Tensor
    position_ids_BT: torch.Tensor | None = None  # None: 0..T-1 on every row
    attention_mask_B1TT: torch.Tensor | None = None  # None: plain causal (right padding is unseen)
    # Packed documents (rltrain.backends.fsdp.micro_batches.padding_free): a token attends to earlier tokens with its
    # own id only. The model's mask is built from it where the model runs (attention_masks).
    document_ids_BT: torch.Tensor | None = None
    # More inputs of the model call, by argument name: the rows' images (rltrain.backends.fsdp.micro_batches.vision_layout).
    model_inputs: dict[str, torch.Tensor] | None = None

    def to(self, device: torch.device) -> Rectangle:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device) if t is not None else None

        return Rectangle(
            self.input_ids_BT.to(device), self.rows_N.to(device), self.cols_N.to(device),
            move(self.position_ids_BT), move(self.attention_mask_B1TT), move(self.document_ids_BT),
            {k: v.to(device) for k, v in self.model_inputs.items()} if self.model_inputs is not None else None,
        )


@dataclass
class _Row:
    tokens_L: torch.Tensor
    positions_L: torch.Tensor
    segments_L: torch.Tensor  # 0: the prompt; k >= 1: the k-th completion of the row
    cols_N: torch.Tensor  # position in the row that predicts each scored token
    dest_N: torch.Tensor  # index of each scored token in the batch's ragged (sequence-major) order


@dataclass(frozen=True)
class PackingCost:
    """Forward cost per layer, in multiply-adds: `linear` per token (every projection), `attention`
    per (query, key) pair of a dense mask (scores and weighted values)."""

    linear: float
    attention: float
    max_row_tokens: int = 4096  # caps the [T, T] mask of a row

    @staticmethod
    def from_config(config) -> PackingCost:
        hidden = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        kv = head_dim * getattr(config, "num_key_value_heads", config.num_attention_heads)
        q = head_dim * config.num_attention_heads
        linear = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size
        return PackingCost(linear=float(linear), attention=2.0 * q)

    def row(self, tokens: int) -> float:
        return tokens * self.linear + tokens * tokens * self.attention


def shared_prompt_groups(batch: SequenceBatch, cost: PackingCost | None = None) -> list[list[int]] | None:
    """Sequence indices grouped by identical prompt, in order of first appearance, each group split
    into the chunks that are cheapest to pack under `cost` (whole groups without it); None when no
    chunk holds two sequences (then packing saves nothing)."""
    offsets = batch.tokens.offsets.tolist()
    values = batch.tokens.values
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, prompt_len in enumerate(batch.prompt_lens.tolist()):
        key = tuple(values[offsets[i] : offsets[i] + prompt_len].tolist())
        by_prompt.setdefault(key, []).append(i)
    groups = list(by_prompt.values())
    if cost is not None:
        comp_lens = batch.completion_lens().tolist()
        prompt_lens = batch.prompt_lens.tolist()
        groups = [
            chunk
            for group in groups
            for chunk in _cheapest_chunks(prompt_lens[group[0]], [comp_lens[i] for i in group], cost, group)
        ]
    if all(len(g) == 1 for g in groups):
        return None
    return groups


def _cheapest_chunks(prompt_len: int, comp_lens: list[int], cost: PackingCost, members: list[int]) -> list[list[int]]:
    """`members` (one prompt's sequences) in consecutive chunks of the size whose rows cost least."""

    def chunks(size: int) -> list[list[int]]:
        return [list(range(i, min(i + size, len(members)))) for i in range(0, len(members), size)]

    def row_tokens(chunk: list[int]) -> int:
        return prompt_len + sum(max(comp_lens[j] - 1, 0) for j in chunk)

    best_size, best_cost = 1, float("inf")
    for size in range(1, len(members) + 1):
        rows = [row_tokens(c) for c in chunks(size)]
        if size > 1 and max(rows) > cost.max_row_tokens:
            break
        total = sum(cost.row(n) for n in rows)
        if total < best_cost:
            best_size, best_cost = size, total
    return [[members[j] for j in chunk] for chunk in chunks(best_size)]


def _packed_row(batch: SequenceBatch, members: list[int], comp_offsets: list[int]) -> _Row:
    offsets = batch.tokens.offsets.tolist()
    values = batch.tokens.values
    first = members[0]
    prompt_len = int(batch.prompt_lens[first])
    parts = [values[offsets[first] : offsets[first] + prompt_len]]
    positions = [torch.arange(prompt_len)]
    segments = [torch.zeros(prompt_len, dtype=torch.long)]
    cols, dest = [], []
    start = prompt_len
    for k, i in enumerate(members, start=1):
        completion = values[offsets[i] + prompt_len : offsets[i + 1]]
        n = completion.numel()
        if n == 0:
            continue
        fed = completion[:-1]  # the last token predicts nothing we score
        parts.append(fed)
        positions.append(torch.arange(prompt_len, prompt_len + n - 1))
        segments.append(torch.full((n - 1,), k, dtype=torch.long))
        # token 0 from the prompt's last position, token j >= 1 from fed token j - 1
        cols.append(torch.cat([torch.tensor([prompt_len - 1]), torch.arange(start, start + n - 1)]))
        dest.append(torch.arange(comp_offsets[i], comp_offsets[i] + n))
        start += n - 1
    empty = torch.zeros(0, dtype=torch.long)
    return _Row(
        torch.cat(parts), torch.cat(positions), torch.cat(segments),
        torch.cat(cols) if cols else empty, torch.cat(dest) if dest else empty,
    )


def _rectangle(rows: list[_Row], pad_id: int, round_width: bool) -> Rectangle:
    """The rows right-padded to the longest (to `packed_width` of it with `round_width`); padding
    sees only itself, so no real token's score changes."""
    width = max(r.tokens_L.numel() for r in rows)
    if round_width:
        width = packed_width(width)
    count = len(rows)
    ids_BT = torch.full((count, width), pad_id, dtype=torch.long)
    positions_BT = torch.zeros((count, width), dtype=torch.long)
    segments_BT = torch.full((count, width), -1, dtype=torch.long)  # -1: padding
    for b, r in enumerate(rows):
        n = r.tokens_L.numel()
        ids_BT[b, :n], positions_BT[b, :n], segments_BT[b, :n] = r.tokens_L, r.positions_L, r.segments_L
    causal_TT = torch.ones(width, width, dtype=torch.bool).tril()
    q_seg, k_seg = segments_BT[:, :, None], segments_BT[:, None, :]
    visible_BTT = causal_TT & (k_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))
    visible_BTT |= torch.eye(width, dtype=torch.bool) & (q_seg < 0)  # padding sees itself
    rows_N = torch.cat([torch.full((r.cols_N.numel(),), b, dtype=torch.long) for b, r in enumerate(rows)])
    return Rectangle(ids_BT, rows_N, torch.cat([r.cols_N for r in rows]), positions_BT, visible_BTT[:, None])


def packed_rectangles(
    batch: SequenceBatch,
    groups: list[list[int]],
    pad_id: int,
    bucket_cost_tokens: int | None,
    round_width: bool = False,
) -> tuple[list[Rectangle], torch.Tensor]:
    """Rectangles of packed rows (one row per prompt group) and `order_N`, the permutation that
    takes their concatenated scored positions back to the batch's ragged order. With
    `bucket_cost_tokens` the rows are split into length buckets (see `length_buckets`), else one
    rectangle (as sharded ranks need: every rank makes the same number of model calls). With
    `round_width` each rectangle is padded to one of a few widths (a compiled model's)."""
    comp_lens = batch.completion_lens().tolist()
    comp_offsets = [0]
    for n in comp_lens:
        comp_offsets.append(comp_offsets[-1] + n)
    rows = [_packed_row(batch, members, comp_offsets) for members in groups]
    if bucket_cost_tokens is None or len(rows) < 2:
        buckets = [list(range(len(rows)))]
    else:
        buckets = length_buckets([r.tokens_L.numel() for r in rows], bucket_cost_tokens)
    rects = [_rectangle([rows[i] for i in bucket], pad_id, round_width) for bucket in buckets]
    dest_N = torch.cat([rows[i].dest_N for bucket in buckets for i in bucket])
    order_N = torch.empty_like(dest_N)
    order_N[dest_N] = torch.arange(dest_N.numel())
    return rects, order_N
