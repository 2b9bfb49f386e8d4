"""Completions generated on a replica's first rank reach its peers exactly (rltrain.rollout.share).

Under Megatron tp/pp the ranks of one data-parallel replica must train on identical sequences, so
only the leader generates, scores and plays episodes. The peers must get the very same token ids,
log-probabilities (bitwise: they feed `rollout/logprob_diff_*`), finished flags, prompt indices and
multi-turn sampled masks, for ragged and empty completions and for an empty step; the same scores
and failure counts; the same episode returns, counts and final replies (non-ASCII included); and a
UserError the leader caught raised on both ranks with its message. (That only the leader calls the engine is GRPO's `_generate`;
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
        # version: the policy version a rollout server reported (rollout=server)
        Completion(prompt_index=3, token_ids=[7], logprobs=[-12.75], finished=False, version=7),
        # prompt_ids: the prompt it continues where it is not the row's (an image row vLLM expanded)
        Completion(prompt_index=5, token_ids=[4, 2], logprobs=[-1.5, -0.25], finished=True, prompt_ids=[1, 9, 9, 9, 3]),
        Completion(prompt_index=4, token_ids=[3, 8, 8, 1], logprobs=[-0.5, 0.0, 0.0, -1e-300], finished=True,
                   sampled=[True, False, False, True]),
    ]


def _episodes():
    from rltrain.envs.episodes import EpisodeResults
    from rltrain.rewards.scoring import Failures

    return EpisodeResults(
        completions=_completions(), returns=[1.0, -0.1, 0.0, 0.5, 2.0 / 3.0], final_texts=["12", "", "héllo\n✓", "seen", "done"],
        failures=Failures(timeouts=2, errors=1), turns=7.0, tool_calls=3.0,
        extra=[_completions()[0], _completions()[2]], extra_episode=[0, 3],  # replies a chat template rewrote
    )


def _as_rows(completions):
    return [(c.prompt_index, c.token_ids, c.logprobs, c.finished, c.sampled, c.prompt_ids, c.version) for c in completions]


def _episode_rows(played):
    return [_as_rows(played.completions), played.returns, played.final_texts,
            [played.failures.timeouts, played.failures.errors], played.turns, played.tool_calls,
            _as_rows(played.extra), played.extra_episode]


def _share(rank: int, world: int) -> list:
    import torch.distributed as dist

    from rltrain.algos.rl.experience import share_scores
    from rltrain.envs.replica import share_results
    from rltrain.rewards.scoring import Failures
    from rltrain.rollout.share import raise_leader_error, replica_leader, share_completions
    from rltrain.runtime.errors import UserError

    group = dist.new_group([0, 1])
    leads = rank == replica_leader(group)
    got = share_completions(_completions() if leads else None, group)
    empty = share_completions([] if leads else None, group)
    played = share_results(_episodes() if leads else None, group)
    scores = ({"a": [0.5, -1.0 / 7.0], "b": [1.0, 0.0]}, Failures(timeouts=1, errors=3))
    per_fn, failures = share_scores(scores if leads else None, ["a", "b"], group)
    raise_leader_error("" if leads else None, group)  # nothing caught: nothing raised
    try:
        raise_leader_error("reward fn exact_match failed on 9 of 16 samples" if leads else None, group)
        raised = ""
    except UserError as exc:
        raised = str(exc)
    return [leads, _as_rows(got), len(empty), _episode_rows(played), [per_fn, [failures.timeouts, failures.errors]], raised]


def test_leader_completions_reach_the_peer_bitwise() -> None:
    leader, peer = run_ranks(_share, nproc=2, timeout_s=120)
    expected = _as_rows(_completions())
    assert leader[0] is True and peer[0] is False  # the lowest rank of the group leads
    assert leader[1] == expected and peer[1] == expected  # == on floats: bitwise
    assert leader[2] == peer[2] == 0
    assert leader[3] == peer[3] == _episode_rows(_episodes())
    assert leader[4] == peer[4] == [{"a": [0.5, -1.0 / 7.0], "b": [1.0, 0.0]}, [1, 3]]
    assert leader[5] == peer[5] == "reward fn exact_match failed on 9 of 16 samples"
