"""Metrics are reduced once per optimizer step, after every micro-batch: one packed tensor, one
all-reduce, keys in sorted order. Reducing inside micro-batches races the gradient collectives of
FSDP/Megatron, and a key that exists on one rank only silently misaligns the packed values, so the
key sets are compared first and a mismatch is an error that names the keys."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist


class MetricKeyMismatch(RuntimeError):
    pass


def _key_checksum(keys: list[str]) -> int:
    return zlib.crc32("\x00".join(keys).encode())


def reduce_metric_sums(metrics: dict[str, float | torch.Tensor], group=None) -> dict[str, float]:
    """Sum each metric over the ranks of `group`. Every rank must hold the same key set."""
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(zip(keys, values.tolist()))
    crc = _key_checksum(keys)
    check = torch.tensor([crc, -crc, len(keys)], dtype=torch.int64)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if int(check[0]) != crc or -int(check[1]) != crc:
        raise MetricKeyMismatch(
            f"rank {dist.get_rank()} reports metric keys {keys}, which differ from another rank's; every rank "
            "must log the same keys each step (a metric computed on one rank only would misalign the reduction)"
        )
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return dict(zip(keys, values.tolist()))
