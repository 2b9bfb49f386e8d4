"""Completions generated on a replica's first rank reach its peers exactly (rltrain.rollout.share).

Under Megatron tp/pp the ranks of one data-parallel replica must train on identical sequences, so
only the leader generates. The peers must get the very same token ids, log-probabilities (bitwise:
they feed `rollout/logprob_diff_*`), finished flags and prompt indices, for ragged and empty
completions and for an empty step. (That only the leader calls the engine is GRPO's `_generate`;
tests/e2e/test_megatron_cli.py runs it with tp=2, where the engine's micro-batch fingerprint
fails the step if the two ranks were given different sequences.)
"""

from __future__ import annotations

import pytest
from helpers import run_ranks

pytestmark = pytest.mark.dist


def _completions():
    from rltrain.rollout.base import Completion

    return [
        Completion(prompt_index=0, token_ids=[5, 9, 2], logprobs=[-0.1, -1.0 / 3.0, -2.5e-9], finished=True),
        Completion(prompt_index=0, token_ids=[], logprobs=[], finished=False),
        Completion(prompt_index=3, token_ids=[7], logprobs=[-12.75], finished=False),
    ]


def _share(rank: int, world: int) -> list:
    import torch.distributed as dist

    from rltrain.rollout.share import replica_leader, share_completions

    group = dist.new_group([0, 1])
    leads = rank == replica_leader(group)
    got = share_completions(_completions() if leads else None, group)
    empty = share_completions([] if leads else None, group)
    as_rows = [(c.prompt_index, c.token_ids, c.logprobs, c.finished) for c in got]
    return [leads, as_rows, len(empty)]


def test_leader_completions_reach_the_peer_bitwise() -> None:
    leader, peer = run_ranks(_share, nproc=2, timeout_s=120)
    expected = [(c.prompt_index, c.token_ids, c.logprobs, c.finished) for c in _completions()]
    assert leader[0] is True and peer[0] is False  # the lowest rank of the group leads
    assert leader[1] == expected and peer[1] == expected  # == on floats: bitwise
    assert leader[2] == peer[2] == 0
