"""Padding-free micro-batches: a micro-batch's sequences concatenated into one row, no padding.

Padding runs wasted positions through every layer; one packed row with restarted positions and
document-causal attention computes exactly the real tokens, in one call, with the unpacked
log-probabilities. docs/internals/backends.md says when it is used (`backend.padding_free`).
"""

from __future__ import annotations

import torch

from rltrain.backends.fsdp.hf_scoring import completion_positions
from rltrain.backends.fsdp.micro_batches.shared_prefix import Rectangle
from rltrain.data.batch import SequenceBatch


def padding_free_rectangle(batch: SequenceBatch) -> Rectangle:
    """The micro-batch as one row `[1, T]` (T: its total tokens), in ragged order, so the scored
    positions come out in ragged order with no permutation."""
    lengths_B = batch.tokens.lengths()
    starts_B = batch.tokens.offsets[:-1]
    document_ids_T = torch.repeat_interleave(torch.arange(len(batch)), lengths_B)
    positions_T = torch.arange(document_ids_T.numel()) - starts_B[document_ids_T]
    seq_N, cols_in_seq_N, _ = completion_positions(batch)
    cols_N = starts_B[seq_N] + cols_in_seq_N
    return Rectangle(
        batch.tokens.values[None],
        torch.zeros_like(seq_N),
        cols_N,
        position_ids_BT=positions_T[None],
        document_ids_BT=document_ids_T[None],
    )
