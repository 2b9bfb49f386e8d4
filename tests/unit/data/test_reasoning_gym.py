"""`data=reasoning_gym` (rltrain/data/reasoning_gym.py, rltrain/rewards/reasoning_gym.py): prompts
from the package's generators, deterministic, held out by question, mixed by weight, the
generator's config keys passed through; each row scored by its own dataset's `score_answer`; and
which held-out answers count as right, per task (rltrain/algos/rl/task_accuracy.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rltrain.algos.rl.task_accuracy import (
    GYM_REWARD,
    accuracy_per_task,
    correct_flags,
    correct_per_task,
    task_names,
)
from rltrain.config.plain_values import tasks_override
from rltrain.data.prompt_data import PromptRow
from rltrain.data.reasoning_gym import reasoning_gym_split
from rltrain.rewards.reasoning_gym import score_answer
from rltrain.runtime.errors import UserError

TASKS = [
    {"name": "chain_sum", "weight": 3, "size": 300, "min_terms": 3, "max_terms": 3, "max_digits": 1},
    {"name": "spell_backward", "size": 100, "seed": 7, "eval_size": 10},
]


def score(problems, answers):
    rows = [p.rl_row for p in problems]
    return score_answer([r["prompt"] for r in rows], answers, [r["rg_task"] for r in rows], [r["rg_config"] for r in rows],
                        [r["rg_index"] for r in rows])


def test_the_split_is_the_generators_own_deterministic_held_out_by_question_and_mixed_by_weight():
    train, held = reasoning_gym_split(TASKS, seed=1, num_eval=40, num_train=800, eval_seed=None)
    again = reasoning_gym_split(TASKS, seed=1, num_eval=40, num_train=800, eval_seed=None)
    assert (train, held) == again
    assert Counter(p.task for p in held) == {"chain_sum": 20, "spell_backward": 10}  # num_eval shared; eval_size kept
    assert not {p.prompt for p in held} & {p.prompt for p in train}
    counts = Counter(p.task for p in train)
    assert sum(counts.values()) == 800 and 0.7 < counts["chain_sum"] / 800 < 0.8  # weights 3 : 1
    sums = [p for p in train if p.task == "chain_sum"]
    assert all(p.prompt.count("+") + p.prompt.count("-") == 2 for p in sums)  # min_terms/max_terms reached the generator
    assert json.loads(next(p for p in train if p.task == "spell_backward").config_json)["seed"] == 7
    other_seed, _ = reasoning_gym_split(TASKS, seed=2, num_eval=40, num_train=800, eval_seed=None)
    assert [p.prompt for p in other_seed[:20]] != [p.prompt for p in train[:20]]


def test_each_row_is_scored_by_its_own_datasets_verifier():
    _, held = reasoning_gym_split(TASKS, seed=0, num_eval=20, num_train=0, eval_seed=None)
    assert score(held, [p.answer for p in held]) == [1.0] * len(held)
    wrong = score(held, ["nonsense" for _ in held])
    assert all(s == 0.0 for s, p in zip(wrong, held, strict=True) if p.task == "chain_sum")
    assert all(s < 1.0 for s in wrong) and any(s > 0.0 for s in wrong)  # spell_backward gives partial credit of its own


def test_unknown_tasks_and_config_keys_are_one_paragraph_each():
    with pytest.raises(UserError, match=r"'chain_summ', which is not a reasoning-gym dataset \(close: chain_sum"):
        reasoning_gym_split(["chain_summ"], 0, 10, 0, None)
    with pytest.raises(UserError, match=r"refused its config .*min_termz.*ChainSumConfig"):
        reasoning_gym_split([{"name": "chain_sum", "min_termz": 2}], 0, 10, 0, None)
    with pytest.raises(UserError, match="needs data.tasks"):
        reasoning_gym_split([], 0, 10, 0, None)


def test_the_tasks_reach_the_sft_start_as_one_hydra_override():
    assert tasks_override(TASKS[1:]) == 'data.tasks=[{name:"spell_backward",size:100,seed:7,eval_size:10}]'


def test_a_held_out_answer_is_right_when_its_verifier_gives_full_marks_and_counted_per_task():
    rows = [PromptRow([1], "q", {"answer": "3", "rg_task": t}) for t in ("b", "a", "b")] + [PromptRow([1], "q", {"answer": "3"})]
    per_fn = {"score_answer": [1.0, 0.5, 0.0, 0.0]}
    flags = correct_flags(["x", "3", "3", "3"], rows, per_fn, {"score_answer": GYM_REWARD})
    assert flags == [True, False, False, True]  # the verifier's full marks; exact match where no task
    assert correct_flags(["x", "3", "3", "3"], rows, per_fn, {"score_answer": "my:fn"}) == [False, True, True, True]
    tasks = task_names(rows)
    assert tasks == ["a", "b"]
    sums = correct_per_task(flags, rows, tasks)
    assert accuracy_per_task(sums, rows, tasks) == {"eval/accuracy/a": 0.0, "eval/accuracy/b": 0.5}


def test_a_missing_package_is_one_paragraph_with_its_install_command(monkeypatch):
    """reasoning-gym (data=reasoning_gym) and textarena (env=textarena) not installed: the command that installs each."""
    import importlib.util

    from rltrain.envs.textarena.game_check import require_textarena

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("reasoning_gym", "textarena") else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'reasoning-gym==0.1.25'` \(the rltrain\[reasoning-gym\] extra"):
        reasoning_gym_split(["chain_sum"], 0, 10, 0, None)
    with pytest.raises(UserError, match=r"pip install 'textarena==0.7.4'` \(the rltrain\[textarena\] extra"):
        require_textarena()
