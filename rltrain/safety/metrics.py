"""Metrics are reduced once per optimizer step, after every micro-batch: one packed tensor, one
all-reduce, keys in sorted order. Reducing inside micro-batches races the gradient collectives of
FSDP/Megatron, and a key that exists on one rank only silently misaligns the packed values, so the
key sets are compared first (one small all-reduce of a checksum) and a mismatch is an error that
names the ranks and the keys."""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from rltrain.runtime.distributed import control_device


class MetricKeyMismatch(RuntimeError):
    """Ranks reported different metric keys for one step (a bug in the code that logs them)."""


def _key_checksum(keys: list[str]) -> int:
    return zlib.crc32("\x00".join(keys).encode())


def _gather_key_lists(keys: list[str], group=None) -> list[list[str]]:
    """Every rank's key list, as JSON bytes through two all-gathers (no pickle)."""
    data = json.dumps(keys).encode()
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=control_device())
    lengths = [torch.zeros(1, dtype=torch.int64, device=control_device()) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    size = int(max(int(n) for n in lengths))
    buf = torch.zeros(size, dtype=torch.uint8, device=control_device())
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(size, dtype=torch.uint8, device=control_device()) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[: int(n)].tolist()).decode()) for b, n in zip(bufs, lengths)]


def _agreed_keys(keys: list[str], partial: bool, group=None) -> list[str]:
    """The key list every rank reduces over, or MetricKeyMismatch naming the ranks and keys."""
    all_keys = _gather_key_lists(keys, group)
    flags = [torch.zeros(1, dtype=torch.int64, device=control_device()) for _ in all_keys]
    dist.all_gather(flags, torch.tensor([int(partial)], dtype=torch.int64, device=control_device()), group=group)
    union = sorted(set().union(*map(set, all_keys)))
    problems = []
    for rank, (rank_keys, flag) in enumerate(zip(all_keys, flags)):
        missing = sorted(set(union) - set(rank_keys))
        if missing and not int(flag):
            problems.append(f"rank {rank} lacks {missing}")
    if problems:
        raise MetricKeyMismatch(
            "metric keys differ between ranks: " + "; ".join(problems) + ". Every rank must log the same keys "
            "each step (a metric computed on one rank only would misalign the packed reduction)."
        )
    return union


def reduce_metric_sums(metrics: Mapping[str, float | torch.Tensor], group=None, partial: bool = False) -> dict[str, float]:
    """Sum each metric over the ranks of `group`. Every rank must hold the same key set, except a
    `partial` rank (one that recovered from an error and so lost a micro-batch's metrics): it
    contributes zero for the keys it lacks."""
    keys = sorted(metrics)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {k: float(metrics[k]) for k in keys}
    crc = _key_checksum(keys)
    check = torch.tensor([crc, -crc], dtype=torch.int64, device=control_device())
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if int(check[0]) != crc or -int(check[1]) != crc:
        keys = _agreed_keys(keys, partial, group)
    values = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64, device=control_device())
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return dict(zip(keys, values.tolist()))
