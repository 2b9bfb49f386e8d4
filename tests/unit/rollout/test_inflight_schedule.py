"""The pure bookkeeping of in-flight generation (rltrain/rollout/inflight_schedule.py): the per-token
bound, admission within vLLM's limits, which batch a completed group joins, when a version is due
in a deterministic run, the version metrics. Hand-worked cases; the engine loop that uses them runs
end to end in tests/e2e/test_cli_inflight.py."""

from __future__ import annotations

from collections import deque

from rltrain.algos.rl.inflight_rollouts import evaluated_versions
from rltrain.rollout.inflight_schedule import (
    Admission,
    Group,
    TakeBook,
    admit_count,
    due_step,
    entry_room,
    too_stale,
    version_stats,
)


def _group(key: int, step: int, position: int, versions: list[list[int]]) -> Group:
    g = Group(key, 100 + key, step, position, [1, 2, 3], seed=7, n=len(versions))
    g.versions = versions
    return g


def test_the_bound_counts_versions_behind_the_trainer_of_the_step():
    # step 5's trainer holds version 4: with k = 1 a token of version 3 is fine, of version 2 not
    assert not too_stale(3, 5, 1)
    assert too_stale(2, 5, 1)
    assert not too_stale(2, 5, 2)
    assert not too_stale(0, 1, 0)  # step 1 at version 0: on-policy


def test_admission_fits_sequences_and_a_whole_prefill_beside_the_running_decodes():
    # 2 running requests take 2 tokens; groups of n = 2 with prompts of 10, 10, 30 tokens
    assert admit_count(2, [10, 10, 30], 2, max_num_seqs=8, token_budget=100) == 2  # 2 + 20 + 20 = 42, + 60 > 100
    assert admit_count(2, [10, 10, 30], 2, max_num_seqs=5, token_budget=1000) == 1  # 2 + 2 + 2 > 5 sequences
    assert admit_count(0, [60], 2, max_num_seqs=8, token_budget=100) == 0  # 120 tokens never prefill in one step
    assert admit_count(0, [], 2, max_num_seqs=8, token_budget=100) == 0


def _state(version: int, filling: int, taken: int, running: int, k: int = 1, stream: bool = True) -> Admission:
    return Admission(version, filling, taken, running, per_step=4, max_staleness=k, stream=stream)


def test_streaming_admits_only_what_the_batches_a_group_can_still_join_have_room_for():
    # k = 1, 4 per step, step 5 being filled with 1 group: version 3 tokens train in step 5 at the latest
    assert entry_room(_state(3, 5, taken=1, running=0), step=9) == 3  # 4 - 1, not 4 * 2
    assert entry_room(_state(3, 5, taken=1, running=3), step=9) == 0
    # version 4 tokens may train in steps 5 and 6: 8 slots, 1 taken, 3 running
    assert entry_room(_state(4, 5, taken=1, running=3), step=9) == 4
    assert entry_room(_state(2, 5, taken=0, running=0), step=9) == 0  # too old for step 5 already
    assert entry_room(_state(4, 5, taken=2, running=1, k=0), step=9) == 1  # on-policy: step 5 only


def test_without_streaming_a_step_opens_once_its_oldest_allowed_version_is_loaded():
    # step 5 with k = 1 needs version 3; up to 4 * 2 groups running, whatever the book holds
    assert entry_room(_state(3, 5, taken=3, running=5, stream=False), step=5) == 3
    assert entry_room(_state(3, 5, taken=0, running=5, stream=False), step=6) == 0
    assert entry_room(_state(3, 5, taken=0, running=9, stream=False), step=5) == 0


def _simulate_stream(per_step: int, k: int, steps: int, lag: int) -> tuple[int, int]:
    """Groups complete in the order they started; version v is loaded `lag` completions after
    step v's batch is complete. Returns (groups generated again, most groups running at once)."""
    book = TakeBook(per_step, k, stream=True, first_step=1)
    version, running, keys, regenerated, most = 0, deque[Group](), 0, 0, 0
    since_full: dict[int, int] = {}
    while book.filling <= steps:
        room = entry_room(Admission(version, book.filling, book.taken(book.filling), len(running), per_step, k, True), step=1)
        for _ in range(room):
            keys += 1
            running.append(_group(keys, 1, 0, [[version]]))
        most = max(most, len(running))
        if not book.place(running.popleft(), version, decode_step=keys):
            regenerated += 1
        for step in list(book.filled_at):
            since_full[step] = since_full.get(step, -1) + 1
        if book.full(version + 1) and since_full[version + 1] >= lag:
            version += 1
    return regenerated, most


def test_streaming_admission_generates_nothing_to_drop_when_groups_complete_in_order():
    for k, lag in [(0, 0), (1, 0), (1, 3), (2, 5)]:
        regenerated, most = _simulate_stream(per_step=4, k=k, steps=8, lag=lag)
        assert regenerated == 0
        assert most == 4 * (k + 1) if lag == 0 else most >= 4  # fresh weights: the whole bound is used


def test_streaming_fills_batches_in_completion_order_and_refuses_groups_with_no_fresh_token():
    book = TakeBook(per_step=3, max_staleness=1, stream=True, first_step=3)  # step 3 trains versions >= 1
    assert book.place(_group(1, 9, 0, [[1, 2], [2]]), current_version=2, decode_step=10)
    assert not book.place(_group(2, 3, 0, [[0, 0], [0]]), current_version=2, decode_step=11)  # every token version 0
    assert book.place(_group(3, 3, 0, [[0, 1], [0]]), current_version=2, decode_step=12)  # partial: its version-1 token
    assert not book.full(3)
    assert book.place(_group(4, 4, 1, [[2]]), current_version=2, decode_step=13)
    assert book.full(3) and book.filled_at == {3: 13} and book.filling == 4
    assert [g.key for g in book.pop(3)] == [1, 3, 4]  # completion order, whatever step each was taken with
    # step 4 trains versions >= 2
    assert not book.place(_group(5, 4, 0, [[1, 1]]), current_version=2, decode_step=14)
    assert book.place(_group(6, 4, 0, [[]]), current_version=2, decode_step=15)  # no token: the current version


def test_without_streaming_a_group_joins_its_own_step_in_prompt_order():
    book = TakeBook(per_step=2, max_staleness=1, stream=False, first_step=1)
    assert book.place(_group(1, 2, 1, [[0]]), current_version=0, decode_step=3)
    assert book.place(_group(2, 1, 0, [[0]]), current_version=0, decode_step=4)
    assert not book.full(1) and not book.full(2)
    assert book.place(_group(3, 2, 0, [[0, 1]]), current_version=1, decode_step=5)
    assert book.full(2) and not book.full(1) and book.filled_at == {2: 5}
    assert [g.position for g in book.pop(2)] == [0, 1]


def test_a_version_is_due_a_fixed_number_of_decode_steps_after_its_batch_completed():
    assert due_step({3: 40}, 3, lag_steps=8) == 48
    assert due_step({3: 40}, 4, lag_steps=8) is None  # step 4's batch is not complete: not due yet


def test_a_new_attempt_keeps_the_prompt_and_draws_new_seeds():
    g = _group(1, 2, 1, [[0, 0]])
    again = g.again(9)
    assert (again.key, again.index, again.step, again.position, again.prompt_ids) == (9, g.index, 2, 1, g.prompt_ids)
    assert again.attempt == 1 and again.seed != g.seed and again.versions == [[]]


def test_version_metrics_over_tokens_and_sequences():
    assert version_stats([[3, 3, 4], [4], [2, 3, 4]]) == {
        "rollout/token_version_min": 2.0, "rollout/token_version_max": 4.0, "rollout/versions_per_sequence_max": 3.0,
    }


def test_the_versions_an_evaluation_follows():
    assert evaluated_versions(2, 5) == [2, 4, 5]
    assert evaluated_versions(0, 3) == [3]
