"""The trainer's side of the in-flight takes (rltrain/algos/rl/inflight_rollouts.py): the next batch
is asked for one step ahead, and `rollout/tokens_per_s` is the batches' tokens over the engine's busy
seconds summed since the stream opened (a batch sampled mostly before the last take, with a sliver
of busy time since, does not read as a huge rate). The engine and the
collector are stand-ins: only the trainer's bookkeeping of the takes runs here."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rltrain.algos.rl.inflight_rollouts import InFlightRollouts
from rltrain.config.schema import PlacementConfig


def _take(busy_s: float, index: int, length: int) -> dict:
    group = {"index": index, "token_ids": [[7] * length], "logprobs": [[-0.5] * length], "versions": [[0] * length], "finished": [True]}
    return {"groups": [group], "busy_s": busy_s, "idle_s": 1.0, "dropped": 0}


class PostedTakes:
    """The engine's two halves of a `take`: which steps were asked for, in order, and when."""

    def __init__(self, takes: list[dict]) -> None:
        self.takes, self.asked, self.log = takes, {}, []

    def request(self, op: str, **fields) -> None:
        assert op == "stream_open", op

    def post(self, op: str, **fields) -> int:
        assert op == "take"
        self.asked[len(self.asked)] = int(fields["step"])
        self.log.append(("post", int(fields["step"])))
        return len(self.asked) - 1

    def reply(self, request_id: int) -> dict:
        self.log.append(("reply", self.asked[request_id]))
        return self.takes.pop(0)


def _collector():
    return SimpleNamespace(
        algo_cfg=SimpleNamespace(prompts_per_step=1, group_size=1), take_prompts=iter([[0], [1], [2], [3], [4], [5], [6], [7]]).__next__,
        my_rows=lambda index: [SimpleNamespace(ids=[3], images=[]) for _ in index],
        sampling=lambda step: SimpleNamespace(seed=step, temperature=1.0, top_p=1.0, max_new_tokens=100, stop_token_ids=[2]),
        assemble=lambda step, index, completions, busy, staleness: SimpleNamespace(
            counts=torch.tensor([float(sum(len(c.token_ids) for c in completions)), 1.0, 0.0, 0.0, 0.0])
        ),
    )


def test_the_rate_sums_tokens_and_busy_time_over_the_takes():
    engine = PostedTakes([_take(2.0, 0, 100), _take(0.001, 1, 100), _take(0.0, 2, 50)])  # the third: no busy time at all
    inflight = InFlightRollouts(_collector(), engine, PlacementConfig(max_staleness=1, weight_update="in_flight"), max_steps=3, eval_versions=[])
    rates = [inflight.next_experience(step)[1]["rollout/tokens_per_s"] for step in (1, 2, 3)]
    assert rates == [100 / 2.0, 200 / 2.001, 250 / 2.001]


def test_the_next_batch_is_asked_for_before_this_one_is_trained():
    """Step t's answer is read, then step t + 1's take is posted before `next_experience(t)`
    returns (the engine answers it as soon as that batch is complete); none after the last step."""
    engine = PostedTakes([_take(1.0, i, 10) for i in range(3)])
    inflight = InFlightRollouts(_collector(), engine, PlacementConfig(max_staleness=1, weight_update="in_flight"), max_steps=3, eval_versions=[])
    inflight.next_experience(1)
    assert engine.log == [("post", 1), ("reply", 1), ("post", 2)]
    inflight.next_experience(2)
    inflight.next_experience(3)
    assert engine.log[3:] == [("reply", 2), ("post", 3), ("reply", 3)]


def test_tokens_older_than_the_bound_are_masked_not_trained():
    """Step 4 with k = 1 trains versions >= 2: a partial rollout's version-1 tokens become context
    (not sampled, log-probability 0), the rest train; the versions reported are the trained ones."""
    from rltrain.algos.rl.inflight_rollouts import partial_rollouts

    groups = [
        {"index": 5, "token_ids": [[7, 8, 9], [4]], "logprobs": [[-0.1, -0.2, -0.3], [-0.4]], "versions": [[1, 2, 3], [1]],
         "finished": [True, False]},
        {"index": 6, "token_ids": [[1, 2]], "logprobs": [[-0.5, -0.6]], "versions": [[2, 3]], "finished": [True]},
    ]
    completions, trained, masked = partial_rollouts(groups, oldest_trained=2)
    assert masked == 2
    assert [c.sampled for c in completions] == [[False, True, True], [False], None]
    assert [c.logprobs for c in completions] == [[0.0, -0.2, -0.3], [0.0], [-0.5, -0.6]]
    assert [c.token_ids for c in completions] == [[7, 8, 9], [4], [1, 2]]  # every token stays, as context or trained
    assert [(c.prompt_index, c.finished) for c in completions] == [(0, True), (0, False), (1, True)]
    assert trained == [[2, 3], [], [2, 3]]
