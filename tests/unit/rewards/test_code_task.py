"""The built-in code task (`data.task=code`, `+experiment=grpo_code`; docs/rewards-and-roles.md,
"The built-in code task"): its rows carry hidden asserts in the `test` layout that
`rltrain.rewards.code:tests_pass` reads, scored here in the real bubblewrap sandbox; the SFT
demonstrations slip on a fixed share of the odd intercepts; the recipe composes onto it. The claim
(held-out pass rate up by 0.15 on seeds 0 and 1) is the slow
tests/e2e/test_convergence.py::test_grpo_code_raises_the_heldout_pass_rate."""

from __future__ import annotations

from helpers import compose_config

from rltrain.data import tasks
from rltrain.rewards import code
from rltrain.rewards.scoring import reward_paths


def test_the_hidden_cases_pass_the_reference_and_fail_the_slip_in_the_sandbox():
    train, held = tasks.code_split(seed=0, num_eval=200)
    assert len(train) + len(held) == 99 * 10 and not set(train) & set(held)
    p = tasks.CodeProblem(23, 7)
    assert (p.prompt, p.answer) == ("f(0)=7;f(10)=237\n", "f=lambda x:23*x+7")
    assert p.rl_row == {"prompt": p.prompt, "test": ["assert f(3) == 76", "assert f(7) == 168", "assert f(-2) == -39"]}
    rows = [q.rl_row for q in held[:6]]
    slipped = [q.answer.replace("+", "-") for q in held[:6]]
    completions = [q.answer for q in held[:6]] + slipped + ["f=lambda x:x", "```python\ndef f(x):\n    return 0\n```"]
    tests = [r["test"] for r in rows] * 2 + [rows[0]["test"], rows[1]["test"]]
    rewards = code.tests_pass([""] * len(completions), completions, test=tests)
    assert rewards[:6] == [1.0] * 6  # any right code passes every hidden case
    assert rewards[6:12] == [1.0 if q.intercept == 0 else 0.0 for q in held[:6]]  # subtracting the intercept fails each
    assert rewards[12:] == [0.0, 0.0]


def test_the_demonstrations_slip_on_a_fixed_share_of_the_odd_intercepts_only():
    train, _ = tasks.code_split(seed=0, num_eval=200)
    odd = [p for p in train if p.intercept % 2]
    assert not any(p.slips for p in train if not p.intercept % 2)
    share = sum(p.slips for p in odd) / len(odd)
    assert abs(share - tasks.CODE_SLIP_SHARE) < 0.05, share
    slip = next(p for p in odd if p.slips)
    assert slip.demonstration("<eos>") == f"f=lambda x:{slip.slope}*x-{slip.intercept}"
    assert [r["completion"] for r in tasks.sft_rows([slip], "<eos>", demonstrations=False)] == [slip.answer]
    assert tasks.code_split(seed=1, num_eval=200, eval_seed=0)[1] == tasks.code_split(seed=0, num_eval=200, eval_seed=0)[1]


def test_the_recipe_composes_onto_the_code_task_and_its_sandboxed_reward():
    cfg = compose_config("+experiment=grpo_code")
    assert (cfg.algo.name, cfg.data.task, cfg.data.path, cfg.model.sft_steps > 0) == ("grpo", "code", None, True)
    assert reward_paths(cfg) == ["rltrain.rewards.code:tests_pass"]
    plain = compose_config("data.task=code")  # the task alone: its reward is the code reward too
    assert reward_paths(plain) == ["rltrain.rewards.code:tests_pass"]
