"""Episodes under Megatron tensor/pipeline parallelism: the replica's leader plays, its peers receive.

The ranks of one replica must train on identical sequences. Environment steps and tool calls are
user code whose timeouts can fire in one process and not in another, so running them on every rank
of a replica would desync it silently; only the leader plays the episodes (all their turns in one
engine turn) and shares what it played. docs/environments.md, "Tensor and pipeline parallelism".
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rltrain.envs.episodes import EpisodeResults
from rltrain.rewards.scoring import Failures
from rltrain.rollout.share import replica_leader, share_completions
from rltrain.runtime.distributed import share_lists, texts_from_ints, texts_to_ints


def share_results(played: EpisodeResults | None, group: Any) -> EpisodeResults:
    """The leader's `played` on every rank of `group` (collective over it; the peers pass None):
    completions (and the extra sequences of rewritten replies) with their sampled masks, returns and
    the counts bitwise, the final replies exactly."""
    sequences = share_completions(played.completions + played.extra if played is not None else None, group)
    ints: list[int] | None = None
    floats: list[float] | None = None
    if dist.get_rank() == replica_leader(group):
        assert played is not None
        extra = [len(played.extra_episode), *played.extra_episode]
        ints = [played.failures.timeouts, played.failures.errors, *extra, *texts_to_ints(played.final_texts)]
        floats = [played.turns, played.tool_calls, *played.returns]
    got_ints, got_floats = share_lists(ints, floats, replica_leader(group), group)
    if played is not None:
        return played
    n_extra = got_ints[2]
    episodes = len(sequences) - n_extra
    return EpisodeResults(
        completions=sequences[:episodes], returns=got_floats[2:], final_texts=texts_from_ints(got_ints[3 + n_extra :]),
        failures=Failures(got_ints[0], got_ints[1]), turns=got_floats[0], tool_calls=got_floats[1],
        extra=sequences[episodes:], extra_episode=got_ints[3 : 3 + n_extra],
    )
