"""Ragged micro-batches to the rectangle megatron's forward needs, and completion tokens back.

A micro-batch is right-padded to its own longest sequence (micro-batches of one step may differ
in length; every pipeline stage derives the same shape from the same micro-batch, so no shape
travels between stages). Under the causal mask real tokens never see the padding, and only the
logits rows of completion tokens are ever read: row (b, p - 1) scores token (b, p). An empty
micro-batch becomes one dummy two-token sequence, so that every rank still runs the same
forward/backward (and the same collectives); its output is zero-weighted and never returned.
`check_same_data` proves, by a cheap fingerprint, that every rank of a replica holds the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.data.batch import SequenceBatch
from rltrain.runtime.distributed import agree_or_raise, control_device


@dataclass
class PaddedMicroBatch:
    tokens_BT: torch.Tensor  # int64, right-padded with 0
    rows_N: torch.Tensor  # batch row of each completion token's predicting logits
    cols_N: torch.Tensor  # position of those logits (token position - 1)
    targets_N: torch.Tensor  # the completion token ids
    completion_lens_B: torch.Tensor  # per real sequence; empty for a dummy batch
    is_dummy: bool
    real_BT: torch.Tensor  # bool, True at the real (not padding) tokens; a dummy's two count

    @property
    def seq_len(self) -> int:
        return int(self.tokens_BT.shape[1])

    @property
    def batch_size(self) -> int:
        return int(self.tokens_BT.shape[0])


def pad_micro_batch(batch: SequenceBatch, device: torch.device) -> PaddedMicroBatch:
    if len(batch) == 0:
        zeros = torch.zeros(1, dtype=torch.long, device=device)
        return PaddedMicroBatch(
            tokens_BT=torch.zeros(1, 2, dtype=torch.long, device=device),
            rows_N=zeros,
            cols_N=zeros,
            targets_N=zeros,
            completion_lens_B=torch.zeros(0, dtype=torch.long),
            is_dummy=True,
            real_BT=torch.ones(1, 2, dtype=torch.bool),
        )
    tokens_BT, real_BT = batch.tokens.to_padded(pad_value=0)
    prompt_lens_B = batch.prompt_lens.to(torch.long)
    completion_lens_B = batch.completion_lens().to(torch.long)
    if bool((completion_lens_B < 0).any()):
        raise ValueError("a sequence is shorter than its prompt")
    batch_size = len(batch)
    rows_N = torch.repeat_interleave(torch.arange(batch_size), completion_lens_B)
    starts_B = torch.cumsum(completion_lens_B, 0) - completion_lens_B
    within_N = torch.arange(rows_N.numel()) - torch.repeat_interleave(starts_B, completion_lens_B)
    cols_N = prompt_lens_B[rows_N] - 1 + within_N
    tokens_BT = tokens_BT.to(torch.long)
    targets_N = tokens_BT[rows_N, cols_N + 1]
    return PaddedMicroBatch(
        tokens_BT=tokens_BT.to(device),
        rows_N=rows_N.to(device),
        cols_N=cols_N.to(device),
        targets_N=targets_N.to(device),
        completion_lens_B=completion_lens_B,
        is_dummy=False,
        real_BT=real_BT,
    )


def fingerprint(batches: list[SequenceBatch]) -> torch.Tensor:
    """[3] int64 (micro-batches, tokens, token-id checksum): equal on ranks given the same data."""
    tokens = sum(b.tokens.num_tokens for b in batches)
    checksum = 0
    for b in batches:
        ids = b.tokens.values.to(torch.long)
        if ids.numel():
            checksum += int((ids * torch.arange(1, ids.numel() + 1)).remainder(1_000_003).sum())
        checksum += int(b.prompt_lens.sum())
    return torch.tensor([len(batches), tokens, checksum], dtype=torch.long)


def check_same_data(micro_batches: list[SequenceBatch], coords: ParallelCoords) -> None:
    """Every tp x pp rank of a replica must hold the same micro-batches; all ranks agree."""
    if coords.tp * coords.pp == 1:
        return
    fp = fingerprint(micro_batches).to(control_device())
    both = torch.cat([fp, -fp])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=coords.mp_group)
    ok = bool(torch.equal(both[:3], -both[3:]))
    agree_or_raise(ok, "micro-batch check (tp/pp ranks of one data-parallel replica were given different data)")
