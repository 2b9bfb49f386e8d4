"""Generate once per data-parallel replica and hand the completions to the replica's other ranks.

The tp x pp ranks of one replica must train on identical sequences, and generation is not bitwise
deterministic across processes, so the replica's leader samples and broadcasts (as raw tensors,
never pickle). What the leader alone runs (rewards, episodes) ends with `raise_leader_error`, so a
UserError there stops its peers too. docs/internals/rollout.md has the reasoning and the wire layout.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rltrain.rollout.base import Completion
from rltrain.runtime.distributed import broadcast_str, share_lists
from rltrain.runtime.errors import UserError


def replica_leader(group: Any) -> int:
    """Global rank that generates for the replica: the lowest rank of `group`."""
    return min(dist.get_process_group_ranks(group))


def leads(group: Any) -> bool:
    """Whether this rank leads its replica (every rank does without a replica group)."""
    return group is None or dist.get_rank() == replica_leader(group)


def raise_leader_error(message: str | None, group: Any) -> None:
    """Collective over `group`: the leader passes the message of the UserError it caught ("" or None
    for none) and every rank raises it, so the peers stop with the leader's words instead of waiting
    for data that never comes. The peers pass None."""
    leader = replica_leader(group)
    shared = broadcast_str((message or "") if dist.get_rank() == leader else None, leader, group)
    if shared:
        raise UserError(shared)


def share_completions(completions: list[Completion] | None, group: Any) -> list[Completion]:
    """The leader's `completions`, on every rank of `group` (collective over it). Non-leaders pass
    None; the leader passes its list (possibly empty). Multi-turn `sampled` masks, the prompts a
    completion continues where they are not the row's (an agent's, an image row vLLM expanded) and
    the servers' policy versions (rollout=server) travel too. An episode's own images
    (`Completion.images`) do not: replica groups exist only under Megatron tp/pp, which refuses
    vision-language models, so a leader holding some is refused here rather than losing them."""
    if completions is not None and any(c.images for c in completions):
        raise ValueError(
            "share_completions does not carry Completion.images: a replica spanning several ranks (Megatron "
            "tp/pp) trains text-only models; its peers would train the sequences without their images"
        )
    leader = replica_leader(group)
    ints: list[int] | None = None
    floats: list[float] | None = None
    if dist.get_rank() == leader:
        if completions is None:
            raise ValueError("the replica's leader must pass its completions")
        for c in completions:
            if len(c.logprobs) != len(c.token_ids):
                raise ValueError("every generated token needs exactly one sampling log-probability")
        ints = [len(completions)]
        for c in completions:
            ints += [c.prompt_index, len(c.token_ids), int(c.finished), int(c.sampled is not None), -1 if c.version is None else c.version]
            ints.append(-1 if c.prompt_ids is None else len(c.prompt_ids))
        for c in completions:
            ints += c.token_ids + [int(f) for f in (c.sampled or [])] + list(c.prompt_ids or [])
        floats = [lp for c in completions for lp in c.logprobs]
    got_ints, got_floats = share_lists(ints, floats, leader, group)
    if completions is not None:
        return completions
    n = got_ints[0]
    meta = [got_ints[1 + 6 * i : 7 + 6 * i] for i in range(n)]
    out, pos, lp_pos = [], 1 + 6 * n, 0
    for prompt_index, length, finished, has_sampled, version, prompt_len in meta:
        token_ids = got_ints[pos : pos + length]
        pos += length
        sampled = None
        if has_sampled:
            sampled = [bool(f) for f in got_ints[pos : pos + length]]
            pos += length
        prompt_ids = None
        if prompt_len >= 0:
            prompt_ids = got_ints[pos : pos + prompt_len]
            pos += prompt_len
        out.append(Completion(
            prompt_index, token_ids, got_floats[lp_pos : lp_pos + length], bool(finished), sampled, prompt_ids,
            version=None if version < 0 else version,
        ))
        lp_pos += length
    return out
