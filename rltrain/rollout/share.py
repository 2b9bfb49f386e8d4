"""Generate once per data-parallel replica and hand the completions to the replica's other ranks.

The tp x pp ranks of one replica must train on identical sequences, and generation is not bitwise
deterministic across processes, so the replica's leader samples and broadcasts (as raw tensors,
never pickle). docs/internals/rollout.md has the reasoning and the wire layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rltrain.rollout.base import Completion
from rltrain.runtime.distributed import control_device


def replica_leader(group: Any) -> int:
    """Global rank that generates for the replica: the lowest rank of `group`."""
    return min(dist.get_process_group_ranks(group))


def share_completions(completions: list[Completion] | None, group: Any) -> list[Completion]:
    """The leader's `completions`, on every rank of `group` (collective over it). Non-leaders pass
    None; the leader passes its list (possibly empty)."""
    leader = replica_leader(group)
    device = control_device()
    is_leader = dist.get_rank() == leader
    if is_leader:
        if completions is None:
            raise ValueError("the replica's leader must pass its completions")
        lengths = [len(c.token_ids) for c in completions]
        header = torch.tensor([len(completions), sum(lengths)], dtype=torch.int64, device=device)
    else:
        header = torch.empty(2, dtype=torch.int64, device=device)
    dist.broadcast(header, src=leader, group=group)
    n, total = (int(v) for v in header.tolist())
    if n == 0:
        return []
    if is_leader:
        assert completions is not None
        rows = [[c.prompt_index, len(c.token_ids), int(c.finished)] for c in completions]
        ints = torch.tensor(
            [v for row in rows for v in row] + [t for c in completions for t in c.token_ids],
            dtype=torch.int64,
            device=device,
        )
        floats = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float64, device=device)
        if floats.numel() != total:
            raise ValueError("every generated token needs exactly one sampling log-probability")
    else:
        ints = torch.empty(3 * n + total, dtype=torch.int64, device=device)
        floats = torch.empty(total, dtype=torch.float64, device=device)
    dist.broadcast(ints, src=leader, group=group)
    dist.broadcast(floats, src=leader, group=group)
    if is_leader:
        assert completions is not None
        return completions
    meta = ints[: 3 * n].view(n, 3).tolist()
    token_ids, logprobs = ints[3 * n :].tolist(), floats.tolist()
    out, start = [], 0
    for prompt_index, length, finished in meta:
        out.append(
            Completion(
                prompt_index=prompt_index,
                token_ids=token_ids[start : start + length],
                logprobs=logprobs[start : start + length],
                finished=bool(finished),
            )
        )
        start += length
    return out

