"""Scoring sequences that share a prompt with the prompt computed once (one packed row per prompt).

Why: GRPO scores `group_size` completions of every prompt and DPO a chosen and a rejected
completion of every prompt; laid out one sequence per row, the model runs over each prompt that
many times. Packed, a row is the prompt followed by each completion, with an attention mask that
lets every completion see the prompt and its own earlier tokens but no other completion, and
position ids that restart after the prompt for each completion. Every scored log-probability is
the one the unpacked sequence gives (to fp32 round-off): attention over a prompt does not depend
on what follows it, and rotary embeddings see the same positions.

What the layout does and does not do:
- Sequences are grouped by identical prompt token ids within one micro-batch; the order they
  come in does not matter, and a prompt held by one sequence is a row of one completion.
- The last token of each completion is not fed (nothing scored is predicted from it), and the
  first completion token is predicted from the prompt's last position, shared by the row.
- Rows are right-padded into rectangles (one, or several of similar length: length buckets); a
  padding position attends only to itself, so no row of the attention is empty (an empty row
  would give NaN, and NaN times a zero gradient is still NaN in the weight gradients).
- It needs a model that takes a 4D boolean `attention_mask` and `position_ids` (Hugging Face
  transformers decoders do); a Mixture-of-Experts model is not packed (its load-balancing loss is
  computed over one plain rectangle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.data.batch import SequenceBatch, length_buckets


@dataclass
class Rectangle:
    """One model call: right-padded rows, and which positions predict the scored tokens."""

    input_ids_BT: torch.Tensor
    rows_N: torch.Tensor
    cols_N: torch.Tensor
    position_ids_BT: torch.Tensor | None = None  # None: 0..T-1 on every row
    attention_mask_B1TT: torch.Tensor | None = None  # None: plain causal (right padding is unseen)

    def to(self, device: torch.device) -> Rectangle:
        return Rectangle(
            *(t.to(device) if t is not None else None for t in (
                self.input_ids_BT, self.rows_N, self.cols_N, self.position_ids_BT, self.attention_mask_B1TT
            ))
        )


@dataclass
class _Row:
    tokens_L: torch.Tensor
    positions_L: torch.Tensor
    segments_L: torch.Tensor  # 0: the prompt; k >= 1: the k-th completion of the row
    cols_N: torch.Tensor  # position in the row that predicts each scored token
    dest_N: torch.Tensor  # index of each scored token in the batch's ragged (sequence-major) order


def shared_prompt_groups(batch: SequenceBatch) -> list[list[int]] | None:
    """Sequence indices grouped by identical prompt, in order of first appearance; None when no
    two sequences share a prompt (then packing saves nothing)."""
    offsets = batch.tokens.offsets.tolist()
    values = batch.tokens.values
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt_len in enumerate(batch.prompt_lens.tolist()):
        key = tuple(values[offsets[i] : offsets[i] + prompt_len].tolist())
        groups.setdefault(key, []).append(i)
    if len(groups) == len(batch):
        return None
    return list(groups.values())


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


def _rectangle(rows: list[_Row], pad_id: int) -> Rectangle:
    width = max(r.tokens_L.numel() for r in rows)
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
    batch: SequenceBatch, groups: list[list[int]], pad_id: int, bucket_cost_tokens: int | None
) -> tuple[list[Rectangle], torch.Tensor]:
    """Rectangles of packed rows (one row per prompt group) and `order_N`, the permutation that
    takes their concatenated scored positions back to the batch's ragged order. With
    `bucket_cost_tokens` the rows are split into length buckets (see `length_buckets`), else one
    rectangle (as sharded ranks need: every rank makes the same number of model calls)."""
    comp_lens = batch.completion_lens().tolist()
    comp_offsets = [0]
    for n in comp_lens:
        comp_offsets.append(comp_offsets[-1] + n)
    rows = [_packed_row(batch, members, comp_offsets) for members in groups]
    if bucket_cost_tokens is None or len(rows) < 2:
        buckets = [list(range(len(rows)))]
    else:
        buckets = length_buckets([r.tokens_L.numel() for r in rows], bucket_cost_tokens)
    rects = [_rectangle([rows[i] for i in bucket], pad_id) for bucket in buckets]
    dest_N = torch.cat([rows[i].dest_N for bucket in buckets for i in bucket])
    order_N = torch.empty_like(dest_N)
    order_N[dest_N] = torch.arange(dest_N.numel())
    return rects, order_N
