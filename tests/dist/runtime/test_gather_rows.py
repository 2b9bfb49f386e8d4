"""`gather_rows` (rltrain.runtime.distributed) on 2 gloo ranks: the full tensor from uneven FSDP-style shards,
without the FutureWarning torch 2.13 gives every call of `all_gather_into_tensor` (once per rank, at
start-up and at every evaluation of a multi-rank FSDP run)."""

from __future__ import annotations

import warnings

import torch
from helpers import run_ranks

from rltrain.runtime.distributed import gather_rows

FULL_ROWS = 5  # torch.chunk over 2 ranks: 3 rows and 2 rows


def _gather(rank: int, world_size: int) -> list[list[float]]:
    full = torch.arange(FULL_ROWS * 2, dtype=torch.float32).reshape(FULL_ROWS, 2)
    local = torch.chunk(full, world_size)[rank]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = gather_rows(local, FULL_ROWS)
    return out.tolist()


def test_every_rank_gets_the_full_tensor_and_no_warning():
    expected = torch.arange(FULL_ROWS * 2, dtype=torch.float32).reshape(FULL_ROWS, 2).tolist()
    assert run_ranks(_gather, nproc=2) == [expected, expected]
