"""Padding-free micro-batches: a micro-batch's sequences concatenated into one row, no padding.

Padding runs wasted positions through every layer; one packed row with restarted positions and
document-causal attention computes exactly the real tokens, in one call, with the unpacked
log-probabilities. docs/internals/backends.md says when it is used (`backend.padding_free`).

A compiled model (flex_attention on CUDA, `backend.compile`) compiles once per row width, so there
the row is padded up to one of a few widths (rltrain.backends.fsdp.micro_batches.widths) with a
filler document no real token sees, and compiles repeat instead of growing with every new total.
"""

from __future__ import annotations

import torch

from rltrain.backends.fsdp.hf_scoring import completion_positions
from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle
from rltrain.backends.fsdp.micro_batches.widths import packed_width
from rltrain.data.batch import SequenceBatch


def padding_free_rectangle(batch: SequenceBatch, pad_id: int = 0, round_width: bool = False) -> Rectangle:
    """The micro-batch as one row `[1, T]` (T: its total tokens, or `packed_width(T)` with
    `round_width`), in ragged order, so the scored positions come out in ragged order with no
    permutation. Filler tokens are `pad_id`s in a document of their own, after every real one: no
    real token attends to them and none is scored, so the scores are those of the unpadded row."""
    lengths_B = batch.tokens.lengths()
    starts_B = batch.tokens.offsets[:-1]
    document_ids_T = torch.repeat_interleave(torch.arange(len(batch)), lengths_B)
    positions_T = torch.arange(document_ids_T.numel()) - starts_B[document_ids_T]
    tokens_T = batch.tokens.values
    filler = packed_width(tokens_T.numel()) - tokens_T.numel() if round_width else 0
    if filler:
        tokens_T = torch.cat([tokens_T, tokens_T.new_full((filler,), pad_id)])
        positions_T = torch.cat([positions_T, torch.arange(filler)])
        document_ids_T = torch.cat([document_ids_T, document_ids_T.new_full((filler,), len(batch))])
    seq_N, cols_in_seq_N, _ = completion_positions(batch)
    cols_N = starts_B[seq_N] + cols_in_seq_N
    return Rectangle(
        tokens_T[None],
        torch.zeros_like(seq_N),
        cols_N,
        position_ids_BT=positions_T[None],
        document_ids_BT=document_ids_T[None],
    )
