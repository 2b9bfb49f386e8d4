"""One reduction of a step's metrics, after every micro-batch (DESIGN invariant 2).

Loss functions run only on the last pipeline stage (on each of its TP ranks, identically). Their
contributions are already globally normalised, so the step's value is the SUM over micro-batches
and data-parallel ranks: `rltrain.safety.metrics.reduce_metric_sums` over the data-parallel group
(it also refuses key sets that differ between ranks). The last stage names the keys and sends
them as JSON bytes (never pickle) to the other stages, which contribute zeros; one sum over the
pipeline group then gives every rank the same result.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.runtime.distributed import control_device
from rltrain.safety.metrics import reduce_metric_sums


def _broadcast_keys(keys: list[str] | None, src: int, group) -> list[str]:
    device = control_device()
    payload = json.dumps(keys).encode() if keys is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    dist.broadcast(size, src=src, group=group)
    if keys is not None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.tolist()).decode())


def reduce_metrics(local: dict[str, float], coords: ParallelCoords, partial: bool = False) -> dict[str, float]:
    """Sum `local` (meaningful on the last stage) over DP ranks; every rank gets the result.
    `partial`: this replica recovered from an error and may lack a failed micro-batch's keys
    (see `reduce_metric_sums`)."""
    last = coords.pp_rank == coords.pp - 1
    keys = sorted(local) if last else None
    if coords.pp > 1:
        pp_ranks = dist.get_process_group_ranks(coords.pp_group)
        keys = _broadcast_keys(keys, src=pp_ranks[-1], group=coords.pp_group)
    assert keys is not None
    reduced = reduce_metric_sums({k: float(local[k]) if last else 0.0 for k in keys}, group=coords.dp_group, partial=partial)
    if coords.pp > 1 and keys:
        values = torch.tensor([reduced[k] for k in keys], dtype=torch.float64, device=control_device())
        dist.all_reduce(values, group=coords.pp_group)
        reduced = dict(zip(keys, values.tolist()))
    return reduced
