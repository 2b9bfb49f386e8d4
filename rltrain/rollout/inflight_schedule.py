"""The pure bookkeeping of in-flight generation (`placement.weight_update=in_flight`).

Which completed group trains at which step, which group is too stale to train, when a new policy
version is due, how many prompts may enter the engine now. No engine here: the rollout process
(rltrain/rollout/inflight_child.py) drives vLLM step by step with it, so that every decision is a
function of counts (groups completed, decode steps taken), which is what makes
`placement.deterministic=true` possible. docs/async.md, "Weights in flight", has the story.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltrain.rollout.seeds import request_seed, retry_seed


@dataclass
class StreamOptions:
    """What `stream_open` carries (rltrain/algos/rl/inflight_rollouts.py sends it; the separate engine's
    loop and the server fleet's stream read it)."""

    stream: bool
    deterministic: bool
    max_staleness: int
    per_step: int
    group_size: int
    lag_steps: int
    version: int  # the version the engine holds now (the trainer's at the first step of this process)
    first_step: int
    expected_groups: int  # prompts the trainer will submit in all (a deterministic run waits for them)
    eval_versions: list[int] = field(default_factory=list)  # versions after which an evaluation follows
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, max_new_tokens, stop_token_ids


@dataclass
class Group:
    """The `n` samples of one prompt, generated together (one attempt: an over-stale group is
    generated again as a new attempt). `step`: the step whose prompts it was taken with;
    `position`: its place in that step's prompts; `seed`: the first sample's (sample j: seed + j)."""

    key: int
    index: int
    step: int
    position: int
    prompt_ids: list[int]
    seed: int
    n: int
    attempt: int = 0
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    routing: list[Any] = field(default_factory=list)  # per sample: [tokens][layers][k] (router replay), or None
    done: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = [[] for _ in range(self.n)]
            self.logprobs = [[] for _ in range(self.n)]
            self.versions = [[] for _ in range(self.n)]
            self.finished = [False] * self.n
            self.routing = [None] * self.n

    def newest_version(self, current: int) -> int:
        """The newest version among its tokens (`current` where it has none: an empty completion)."""
        return max((v for vs in self.versions for v in vs), default=current)

    def again(self, key: int) -> Group:
        """A fresh attempt at the same prompt, with its own seeds."""
        return Group(key, self.index, self.step, self.position, self.prompt_ids, retry_seed(self.seed), self.n, self.attempt + 1)


def submitted_group(row: dict[str, Any], key: int, group_size: int) -> Group:
    """One `submit` row as a group, seeded as the batch `generate` seeds the same prompt of the same
    step (rltrain/rollout/vllm.py)."""
    return Group(
        key, int(row["index"]), int(row["step"]), int(row["position"]), [int(t) for t in row["prompt_ids"]],
        request_seed(int(row["seed"]), int(row["position"]), group_size), group_size,
    )


@dataclass(frozen=True)
class Admission:
    """What decides how many groups may start now: the version the engine holds, the batch being
    filled (`filling`, holding `taken` groups already) and the groups `running` (started, not complete)."""

    version: int
    filling: int
    taken: int
    running: int
    per_step: int
    max_staleness: int
    stream: bool


def entry_room(a: Admission, step: int) -> int:
    """How many more groups may start now, the next being one of step `step`'s prompts.

    Without streaming: up to `per_step` * (k + 1) running, once version step - 1 - k is loaded (the
    bound then holds by construction). Streaming: a group started under version v trains at the
    latest in step v + 1 + k, so only as many may start as the batches from the one being filled
    to that step still have room for, less those already running (which complete first, or hold
    older tokens). More would complete too stale for any batch and be generated again; fewer would
    leave the engine idle with room left. docs/async.md, "The per-token bound"."""
    if not a.stream:
        open_ = a.version >= oldest_trained_version(step, a.max_staleness)
        return max(0, a.per_step * (a.max_staleness + 1) - a.running) if open_ else 0
    last_step = a.version + 1 + a.max_staleness
    return max(0, a.per_step * (last_step - a.filling + 1) - a.taken - a.running)


def oldest_trained_version(train_step: int, max_staleness: int) -> int:
    """The oldest version a token trained in step `train_step` may come from: the trainer of that
    step holds version `train_step - 1`, and no token is more than `max_staleness` behind it."""
    return train_step - 1 - max_staleness


def too_stale(version: int, train_step: int, max_staleness: int) -> bool:
    """True when a token of `version` is older than step `train_step` may train on."""
    return version < oldest_trained_version(train_step, max_staleness)


def admit_count(running: int, prompt_lens: list[int], n: int, max_num_seqs: int, token_budget: int) -> int:
    """How many groups from the head of `prompt_lens` may enter the engine now: every one of their
    `n` requests must fit `max_num_seqs` beside the `running` ones, and all their prompts must
    prefill whole in the next step's token budget beside one decode token per running request
    (vLLM's CPU build cannot prefill a seeded request in chunks, rltrain/rollout/vllm.py)."""
    count, seqs, tokens = 0, running, running
    for length in prompt_lens:
        if seqs + n > max_num_seqs or tokens + n * length > token_budget:
            break
        count, seqs, tokens = count + 1, seqs + n, tokens + n * length
    return count


class TakeBook:
    """Completed groups assigned to the steps that train them.

    `stream`: a group goes to the step being filled (the first one with fewer than `per_step`
    groups), in completion order; otherwise to its own step, in prompt order. A group that holds a
    token within the per-token bound there is placed, its older tokens left for the trainer to mask
    (a partial rollout: trained from where the bound allows, docs/async.md "The per-token bound");
    one with none is refused (`place` returns False) and the caller generates it again.
    `filled_at[s]` is the decode step at which step s's batch became complete."""

    def __init__(self, per_step: int, max_staleness: int, stream: bool, first_step: int) -> None:
        self.per_step, self.k, self.stream = per_step, max_staleness, stream
        self.filling = first_step
        self.assigned: dict[int, list[Group]] = {}
        self.filled_at: dict[int, int] = {}

    def place(self, group: Group, current_version: int, decode_step: int) -> bool:
        target = self.filling if self.stream else group.step
        if too_stale(group.newest_version(current_version), target, self.k):
            return False
        batch = self.assigned.setdefault(target, [])
        batch.append(group)
        if len(batch) == self.per_step:
            self.filled_at[target] = decode_step
            if not self.stream:
                batch.sort(key=lambda g: g.position)
        while self.stream and len(self.assigned.get(self.filling, ())) >= self.per_step:
            self.filling += 1
        return True

    def taken(self, step: int) -> int:
        """Groups placed in step `step`'s batch so far."""
        return len(self.assigned.get(step, ()))

    def full(self, step: int) -> bool:
        return step in self.filled_at

    def pop(self, step: int) -> list[Group]:
        return self.assigned.pop(step)


def due_step(filled_at: dict[int, int], version: int, lag_steps: int) -> int | None:
    """The decode step before which version `version` is applied in a deterministic run: `lag_steps`
    after the batch that trains into it (step `version`'s) became complete; None while it is not."""
    filled = filled_at.get(version)
    return None if filled is None else filled + lag_steps


def version_stats(versions_by_sequence: list[list[int]]) -> dict[str, float]:
    """`rollout/token_version_min`/`_max` over every token, `rollout/versions_per_sequence_max`."""
    tokens = [v for seq in versions_by_sequence for v in seq]
    return {
        "rollout/token_version_min": float(min(tokens, default=0)),
        "rollout/token_version_max": float(max(tokens, default=0)),
        "rollout/versions_per_sequence_max": float(max((len(set(seq)) for seq in versions_by_sequence), default=0)),
    }
