"""Code rewards: `reward.fns=[rltrain.rewards.code:tests_pass]` runs each completion's code against
its row's tests in the sandbox (rltrain/rewards/sandbox) and scores the fraction of cases passed.

The code is the last fenced block after any thinking block, else that whole answer. The tests are
stdin/stdout cases (`input_output`: APPS, TACO, CodeContests, LiveCodeBench) or assert statements
(`test`, optional `entry_point`: MBPP, HumanEval); each case is one execution. Formats, metrics and
the security model: docs/rewards-and-roles.md ("Code").
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rltrain.rewards.sandbox.base import Execution, Outcome
from rltrain.rewards.sandbox.settings import CodeSettings, current_settings, sandbox_for
from rltrain.rewards.thinking import answer_after_thinking, current_end_marker

FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
# The per-sample series `tests_pass_reported` returns beside the rewards; summed ones are counts.
METRICS = ("code_pass_rate", "code_timeouts", "code_errors", "sandbox_killed")
COUNTED = frozenset({"code_timeouts", "code_errors", "sandbox_killed"})


def extract_code(completion: str, thinking_end: str) -> str:
    """The last fenced code block of the answer (after the thinking block), else the whole answer."""
    answer = answer_after_thinking(completion, thinking_end)
    blocks = FENCE.findall(answer)
    return blocks[-1][1] if blocks else answer


@dataclass
class Case:
    execution: Execution
    expected: str | None  # stdout it must print; None: passing is running to its end
    returns: bool = False  # `expected` is the JSON of what the function must return (APPS's fn_name cases)


# APPS / TACO call-based cases: the function `fn_name` (module level, or a method of LeetCode's
# `class Solution`) called with the case's argument list from stdin; its result printed as JSON last.
CALL_HARNESS = """

import json as _rltrain_json, sys as _rltrain_sys
_rltrain_fn = globals().get({name!r}) or getattr(globals()["Solution"](), {name!r})
_rltrain_result = _rltrain_fn(*_rltrain_json.loads(_rltrain_sys.stdin.read()))
print()
print(_rltrain_json.dumps(_rltrain_result))
"""


def stdio_cases(code: str, input_output: Any) -> list[Case]:
    spec = json.loads(input_output) if isinstance(input_output, str) else input_output
    if not isinstance(spec, dict) or not isinstance(spec.get("inputs"), list) or not isinstance(spec.get("outputs"), list):
        raise ValueError("an input_output value must be a dict (or its JSON) with 'inputs' and 'outputs' lists")
    if len(spec["inputs"]) != len(spec["outputs"]):
        raise ValueError(f"input_output has {len(spec['inputs'])} inputs but {len(spec['outputs'])} outputs")
    if spec.get("fn_name"):
        program = code + CALL_HARNESS.format(name=str(spec["fn_name"]))
        return [
            Case(Execution(program, json.dumps(args if isinstance(args, list) else [args]), exit_ends=False), json.dumps(out), returns=True)
            for args, out in zip(spec["inputs"], spec["outputs"], strict=True)
        ]
    return [Case(Execution(code, text_of(i)), text_of(o)) for i, o in zip(spec["inputs"], spec["outputs"], strict=True)]


def assert_cases(code: str, test: str | list[str], entry_point: str | None) -> list[Case]:
    """One case per test string: MBPP's list gives one per assert, HumanEval's string one for its
    `check(candidate)`, which is called on `entry_point`."""
    tests = [test] if isinstance(test, str) else list(test)

    def program(t: str) -> str:
        call = f"\n\ncheck({entry_point})\n" if entry_point and "def check(" in t else "\n"
        return f"{code}\n\n{t}{call}"

    return [Case(Execution(program(t), exit_ends=False), None) for t in tests]


def text_of(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def same_output(got: str, expected: str) -> bool:
    """Equal line by line, ignoring trailing whitespace on each line and trailing blank lines."""
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(got) == lines(expected)


def passed(case: Case, outcome: Outcome) -> bool:
    if outcome.status != "ran" or case.expected is None:
        return outcome.status == "ran"
    if not case.returns:
        return same_output(outcome.stdout, case.expected)
    try:
        got = json.loads(outcome.stdout.rstrip("\n").rsplit("\n", 1)[-1])
    except ValueError:
        return False
    expected = json.loads(case.expected)
    return got == expected or [got] == expected  # APPS wraps most expected results in a list


@dataclass
class Tally:
    """One completion's cases: how many passed, of how many, and their executions' statuses."""

    passed: int
    total: int
    statuses: set[str]


def cases_of(code: str, row: dict[str, Any]) -> list[Case]:
    if row.get("input_output") is not None:
        return stdio_cases(code, row["input_output"])
    if row.get("test") is not None:
        return assert_cases(code, row["test"], row.get("entry_point"))
    raise ValueError(
        "rltrain.rewards.code:tests_pass needs each row's tests: an 'input_output' column (stdin/stdout cases: "
        "{'inputs': [...], 'outputs': [...]}) or a 'test' column (assert statements, optional 'entry_point'); "
        f"this row has {sorted(k for k, v in row.items() if v is not None)}. Name yours with "
        "data.columns.input_output=COLUMN or data.columns.test=COLUMN, or build them with data.map_fn"
    )


def run_tests(completions: list[str], columns: dict[str, list], settings: CodeSettings) -> list[Tally]:
    """Every completion's cases, `reward.sandbox.workers` executions at once; identical executions
    (a group's identical completions on one case) run once, each copy getting its outcome. A
    completion with a case past its time skips its cases not yet started (they fail): looping code
    costs one timeout."""
    sandbox = sandbox_for(settings.sandbox)
    rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
    marker = current_end_marker()
    all_cases = [cases_of(extract_code(c, marker), row) for c, row in zip(completions, rows, strict=True)]
    owners = [i for i, cases in enumerate(all_cases) for _ in cases]
    executions = [case.execution for cases in all_cases for case in cases]
    copies: dict[tuple[str, str, bool], list[int]] = {}  # one execution -> the indices of its copies
    for i, e in enumerate(executions):
        copies.setdefault((e.program, e.stdin, e.exit_ends), []).append(i)
    timed_out: set[int] = set()

    def run(indices: list[int]) -> Outcome:
        whose = {owners[i] for i in indices}
        if whose <= timed_out:
            return Outcome("timeout", "", "skipped: an earlier case of this completion ran out of time")
        outcome = sandbox.run(executions[indices[0]])
        if outcome.status == "timeout":
            timed_out.update(whose)
        return outcome

    with ThreadPoolExecutor(settings.sandbox.workers, thread_name_prefix="rltrain-sandbox") as pool:
        ran = list(pool.map(run, copies.values()))
    outcome_of = {i: outcome for indices, outcome in zip(copies.values(), ran, strict=True) for i in indices}
    flat = [outcome_of[i] for i in range(len(executions))]
    scored, start = [], 0
    for cases in all_cases:
        outcomes = flat[start : start + len(cases)]
        start += len(cases)
        scored.append(Tally(sum(passed(c, o) for c, o in zip(cases, outcomes, strict=True)), len(cases), {o.status for o in outcomes}))
    return scored


def reward_of(s: Tally, all_or_nothing: bool) -> float:
    if s.total == 0:
        return 0.0
    return float(s.passed == s.total) if all_or_nothing else s.passed / s.total


def tests_pass_reported(prompts: list[str], completions: list[str], **columns: list) -> dict[str, Any]:
    """`tests_pass`'s rewards and, per sample, its METRICS (what a run's scorer calls)."""
    settings = current_settings()
    scored = run_tests(completions, columns, settings)
    return {
        "rewards": [reward_of(s, settings.code.all_or_nothing) for s in scored],
        "metrics": {
            "code_pass_rate": [s.passed / s.total if s.total else 0.0 for s in scored],
            "code_timeouts": [float("timeout" in s.statuses) for s in scored],
            "code_errors": [float("error" in s.statuses) for s in scored],
            "sandbox_killed": [float("killed" in s.statuses) for s in scored],
        },
    }


def tests_pass(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """Per completion, the fraction of its row's test cases its code passes (1.0 or 0.0 with
    `reward.code.all_or_nothing`), each case run in the sandbox."""
    return tests_pass_reported(prompts, completions, **columns)["rewards"]
