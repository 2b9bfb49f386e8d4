"""Router replay's record through the in-flight loop (rltrain/rollout/inflight_child.py,
docs/moe.md "Recording in flight").

The loop steps vLLM's engine itself, so no `generate` call arms and takes the tap
(rltrain/rollout/vllm_routing.py); and its seeds are not unique (a step's seeds repeat a
regenerated group's, an evaluation's). So, as a server does, each request carries a key of its
own (its vLLM request id) in `SamplingParams.extra_args`, the tap keeps each sample's rows under
that key and the sample's seed, and each finished sample's record is taken before its group
completes (one call into the worker for every sample finished since the last) and kept with the
group, cut to its tokens: each token's experts from the forward, and so the version, that sampled it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rltrain.rollout.inflight_schedule import Group
from rltrain.rollout.server.routing_wire import ROUTING_ARG, sample_key
from rltrain.rollout.vllm_routing import completion_routing

TakeKeys = Callable[[list[str]], dict[str, torch.Tensor]]


class StreamRecords:
    """The loop's side of the tap: marks each training request, collects its samples as they
    finish, files their records into their groups (`Group.routing`) before a group completes."""

    def __init__(self, take_keys: TakeKeys) -> None:
        self.take_keys = take_keys
        self.finished: list[tuple[Group, int, str]] = []  # (group, sample, tap key), finished this step

    @staticmethod
    def extra_args(request_id: str) -> dict[str, Any]:
        """What a recorded request's `SamplingParams.extra_args` carry (an evaluation's carry none)."""
        return {ROUTING_ARG: request_id}

    def sample_finished(self, request_id: str, group: Group, j: int) -> None:
        """Sample `j` of the group (vLLM seeds it `group.seed + j`) is done: its record is due."""
        self.finished.append((group, j, sample_key(request_id, group.seed + j)))

    def file(self) -> None:
        """Take the records of the samples finished since the last call and keep each in its group
        as nested lists (control_wire's form), None where the tap kept nothing."""
        if not self.finished:
            return
        records = self.take_keys([key for _, _, key in self.finished])
        for group, j, key in self.finished:
            record = completion_routing(records, key, len(group.token_ids[j]))
            group.routing[j] = None if record is None else record.tolist()
        self.finished = []
