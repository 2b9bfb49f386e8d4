"""Splitting a global batch across ranks and micro-batches so every rank runs the same number of
forward/backward passes (FSDP and Megatron collectives must match), even when the batch does not
divide evenly: short ranks get empty micro-batches, which engines turn into zero-loss passes."""

from __future__ import annotations

import math
from typing import TypeVar

import torch
import torch.distributed as dist

from rltrain.distributed import all_reduce_sum

T = TypeVar("T")


def rank_slice(items: list[T], rank: int, world_size: int) -> list[T]:
    """Contiguous, near-equal slices: the first `len % world` ranks get one extra item."""
    base, extra = divmod(len(items), world_size)
    start = rank * base + min(rank, extra)
    return items[start : start + base + (1 if rank < extra else 0)]


def micro_batch_count(global_size: int, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches per rank: enough for the largest rank slice (identical on every rank)."""
    largest = math.ceil(global_size / world_size)
    return max(1, math.ceil(largest / micro_batch_size))


def split_micro_batches(items: list[T], count: int, micro_batch_size: int) -> list[list[T]]:
    """`count` micro-batches of at most `micro_batch_size` items (trailing ones may be empty)."""
    return [items[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(count)]


def sum_over_replicas(values: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Sum per-slice results over data-parallel replicas. Every rank all-reduces; the ranks of one
    replica (tensor/pipeline parallel) hold identical values, so the world sum is divided by the
    model-parallel size, which is exact for these copies."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    return all_reduce_sum(values) / (dist.get_world_size() // dp_size)
