"""Splitting a global batch across ranks and micro-batches so every rank runs the same number of
forward/backward passes (FSDP and Megatron collectives must match), even when the batch does not
divide evenly: short ranks get empty micro-batches, which engines turn into zero-loss passes."""

from __future__ import annotations

import math
from typing import TypeVar

import torch
import torch.distributed as dist

from rltrain.runtime.distributed import all_reduce_sum, global_max

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


def split_micro_batches(
    items: list[T], count: int, micro_batch_size: int, sizes: list[int] | None = None, max_tokens: int = 0
) -> list[list[T]]:
    """`count` micro-batches of at most `micro_batch_size` items (trailing ones may be empty).

    With a token budget (`max_tokens > 0`, `sizes[i]` the tokens of `items[i]`:
    `trainer.max_tokens_per_micro_batch`), micro-batches are filled in order up to
    `micro_batch_size` items *and* `max_tokens` tokens (an item longer than the budget gets one of
    its own), so a batch of long rows is not scored in one oversized call and a batch of short rows
    not in many small ones. Their number is then agreed over every rank (one MAX all-reduce, so
    every rank must call this together) and short ranks get empty micro-batches, instead of `count`.
    Losses are normalised by global counts, so the split does not change them.
    """
    if max_tokens <= 0:
        return [items[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(count)]
    if sizes is None or len(sizes) != len(items):
        raise ValueError("a token budget needs the size of every item")
    groups: list[list[T]] = []
    current: list[T] = []
    tokens = 0
    for item, size in zip(items, sizes):
        if current and (len(current) == micro_batch_size or tokens + size > max_tokens):
            groups.append(current)
            current, tokens = [], 0
        current.append(item)
        tokens += size
    if current:
        groups.append(current)
    agreed = int(global_max(float(max(1, len(groups)))))
    return groups + [[] for _ in range(agreed - len(groups))]


def sum_over_replicas(values: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Sum per-slice results over data-parallel replicas. Every rank all-reduces; the ranks of one
    replica (tensor/pipeline parallel) hold identical values, so the world sum is divided by the
    model-parallel size, which is exact for these copies."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    return all_reduce_sum(values) / (dist.get_world_size() // dp_size)
