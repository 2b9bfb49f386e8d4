"""One reduction of a step's metrics, after every micro-batch (DESIGN invariant 2).

Loss functions run only on the last pipeline stage (on each of its TP ranks, identically). Their
contributions are already globally normalised, so the step's value is the SUM over micro-batches
and data-parallel ranks. The last stage names the keys (sent as JSON bytes, never pickle, to the
other stages); data-parallel ranks must agree on the key set, checked with one MAX-reduced hash,
so a key present on one rank only is an error on every rank instead of a silently shifted vector.
"""

from __future__ import annotations

import json
import zlib

import torch
import torch.distributed as dist

from rltrain.backends.megatron.groups import Layout


def _broadcast_keys(keys: list[str] | None, src: int, group) -> list[str]:
    payload = json.dumps(keys).encode() if keys is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if keys is not None else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.tolist()).decode())


def reduce_metrics(local: dict[str, float], layout: Layout) -> dict[str, float]:
    """Sum `local` (meaningful on the last stage) over DP ranks; every rank gets the result."""
    last = layout.pp_rank == layout.pp - 1
    keys = sorted(local) if last else None
    if layout.pp > 1:
        pp_ranks = dist.get_process_group_ranks(layout.pp_group)
        keys = _broadcast_keys(keys, src=pp_ranks[-1], group=layout.pp_group)
    assert keys is not None
    if layout.dp > 1:
        digest = zlib.crc32(json.dumps(keys).encode())
        check = torch.tensor([digest, -digest], dtype=torch.long)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=layout.dp_group)
        if int(check[0]) != -int(check[1]):
            raise RuntimeError(
                f"metric keys differ across data-parallel ranks (this rank has {keys}); every rank's "
                "loss_fn must return the same metric names"
            )
    values = torch.tensor([float(local[k]) if last else 0.0 for k in keys], dtype=torch.float64)
    if values.numel():
        if layout.dp > 1:
            dist.all_reduce(values, group=layout.dp_group)
        if layout.pp > 1:
            dist.all_reduce(values, group=layout.pp_group)
    return dict(zip(keys, values.tolist()))
