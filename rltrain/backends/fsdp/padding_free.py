"""Padding-free micro-batches: a micro-batch's sequences concatenated into one row, no padding.

Why: a micro-batch padded to its longest sequence runs every padding position through every layer
(with lengths spread over 30-250 tokens, about 1.7x the real tokens); length buckets cut that at
the price of more, smaller model calls. One packed row computes exactly the real tokens in one
call. Position ids restart at 0 for each sequence, so rotary embeddings see the positions the
sequence alone would see, and attention is block-diagonal causal (`document_ids_BT`: a token sees
only earlier tokens of its own sequence), so every scored log-probability is the one the unpacked
sequence gives, to fp32 round-off, gradients included.

The mask is built where the model runs (rltrain.backends.fsdp.attention_masks): a dense boolean
`[1, 1, T, T]` mask for sdpa (CPU and the tests; memory T^2 for the row), or on CUDA a
flex_attention `BlockMask`, block-sparse, so the row costs its documents' attention and not the
square's.

When it is used (`backend.padding_free`, rltrain.backends.fsdp.layout): shared-prompt packing
(rltrain.backends.fsdp.shared_prefix) still wins when it applies, since it computes each shared prompt
once (its rows stay right-padded); padding-free replaces the padded rectangle or length buckets
otherwise. A MoE model is never packed (its load-balancing loss is computed over a plain
rectangle). One row is one model call, which is what sharded FSDP ranks need.
"""

from __future__ import annotations

import torch

from rltrain.backends.fsdp.hf_scoring import completion_positions
from rltrain.backends.fsdp.shared_prefix import Rectangle
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
