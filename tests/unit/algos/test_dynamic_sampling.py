"""DAPO's dynamic sampling, the bookkeeping: which groups carry signal and which one rank trains on
(rltrain/algos/rl/dynamic_sampling.py). The rounds in real runs, resumed and generating ahead:
tests/e2e/test_cli_dynamic_sampling.py."""

from __future__ import annotations

import torch

from rltrain.algos.rl.dynamic_sampling import SignalGroups, groups_with_signal
from rltrain.data.prompt_data import PromptRow
from rltrain.rewards.scoring import Failures, Scored
from rltrain.rollout.base import Completion


def test_a_group_has_signal_when_its_rewards_differ():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    assert groups_with_signal(scores, 2) == [False, True, False, False]
    assert groups_with_signal(scores, 4) == [True, True]


def _round(names: list[str], rewards: list[list[float]]):
    rows = [PromptRow(ids=[i], text=name, columns={}) for i, name in enumerate(names)]
    completions = [Completion(prompt_index=i, token_ids=[10 * i + k], logprobs=[-1.0], finished=True)
                   for i, group in enumerate(rewards) for k in range(len(group))]
    flat = [r for group in rewards for r in group]
    return rows, completions, Scored({"fn": flat}, Failures(errors=1), torch.tensor(flat, dtype=torch.float64))


def test_the_first_groups_with_signal_are_kept_in_order_across_rounds():
    picker = SignalGroups(wanted=3, group_size=2)
    picker.offer(*_round(["a", "b", "c"], [[1, 0], [0, 0], [1, 1]]))
    assert picker.missing == 2
    picker.offer(*_round(["d", "e", "f"], [[0, 0], [0, 1], [1, 0]]))
    assert picker.missing == 0
    rows, completions, scored = picker.batch()
    assert [r.text for r in rows] == ["a", "e", "f"]
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2]  # renumbered to their row
    assert [c.token_ids[0] for c in completions] == [0, 1, 10, 11, 20, 21]
    assert scored.per_fn["fn"] == [1, 0, 0, 1, 1, 0] and scored.scores_B.tolist() == [1, 0, 0, 1, 1, 0]
    assert scored.failures == Failures(errors=2)  # every round's failures count
    assert (picker.dropped, picker.filled) == (3, 0)  # b, c, d


def test_a_short_batch_is_filled_with_the_first_groups_dropped():
    picker = SignalGroups(wanted=3, group_size=2)
    picker.offer(*_round(["a", "b", "c"], [[0, 0], [1, 0], [1, 1]]))
    rows, _, scored = picker.batch()
    assert [r.text for r in rows] == ["b", "a", "c"]
    assert scored.scores_B.tolist() == [1, 0, 0, 0, 1, 1]
    assert (picker.dropped, picker.filled) == (0, 2)
