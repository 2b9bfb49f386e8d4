"""A math answer checker as a reward: `reward.fns=[rltrain.rewards.math:accuracy]`.

The completion's final answer is compared with the dataset's `solution` column (TRL's convention;
a GSM8K-style solution counts from its last `####`) by math-verify, which understands LaTeX
(`\\boxed{}`, fractions), commas in numbers and units. Some answers make sympy run for minutes and
math-verify's own timeout needs the main thread, so every sample is checked in a worker process
with a deadline: a sample past it scores 0 and the worker is killed and replaced, so one
pathological answer costs its own sample, not the step. docs/rewards-and-roles.md.
"""

from __future__ import annotations

import importlib
import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

from rltrain.rewards.thinking import answer_after_thinking, current_end_marker
from rltrain.runtime.call_pool import receive, send

SAMPLE_TIMEOUT_S = 5.0  # per sample; the whole call is still bounded by reward.timeout_s
STARTUP_S = 30.0  # a fresh worker's first sample may also wait for its imports
GSM8K_MARK = "####"


def final_solution(solution: str) -> str:
    """The answer part of a solution: after the last `####` (GSM8K), else all of it."""
    return solution.rsplit(GSM8K_MARK, 1)[-1].strip()


def answers_match(completion: str, solution: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the solution's, else 0.0. No
    time limit of its own: call it through `AnswerChecker`."""
    from math_verify import parse, verify

    gold = parse(final_solution(solution), parsing_timeout=None)
    if not gold:
        return 0.0
    answer = parse(completion, parsing_timeout=None)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=None))


def _serve(conn: Connection, check_path: str) -> None:
    """The worker: one (completion, solution) in, one score out, until the pipe closes."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": ours is outside
    module, name = check_path.split(":")
    check = getattr(importlib.import_module(module), name)
    while True:
        try:
            completion, solution = receive(conn)
        except EOFError:
            return
        try:
            send(conn, float(check(completion, solution)))
        except Exception:  # an answer math-verify cannot handle is a wrong answer
            send(conn, 0.0)


class AnswerChecker:
    """`check_path` (`module:fn`) in a worker process, each sample within `timeout_s`. The worker
    starts on first use (spawned: it shares no threads or locks with the trainer)."""

    def __init__(self, check_path: str = f"{__name__}:answers_match", timeout_s: float = SAMPLE_TIMEOUT_S) -> None:
        self.check_path, self.timeout_s = check_path, timeout_s
        self.process: Any = None
        self.conn: Connection | None = None
        self.timeouts = 0  # samples that ran past the deadline (and cost a worker)
        self.starting = False  # the worker has not answered yet (its imports may still run)

    def _start(self) -> Connection:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, self.check_path), daemon=True, name="rltrain-math")
        self.process.start()
        child.close()
        self.conn = parent
        self.starting = True
        return parent

    def _kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.process, self.conn = None, None

    def score(self, completion: str, solution: str) -> float:
        conn = self.conn if self.conn is not None and self.process.is_alive() else self._start()
        send(conn, [completion, solution])
        if conn.poll(self.timeout_s + (STARTUP_S if self.starting else 0.0)):
            self.starting = False
            return float(receive(conn))
        self.timeouts += 1
        self._kill()
        return 0.0

    def close(self) -> None:
        self._kill()


_checker: AnswerChecker | None = None


def accuracy(prompts: list[str], completions: list[str], solution: list[str] | None = None, **_: object) -> list[float]:
    """1.0 per completion whose final answer equals its `solution` (math-verify), else 0.0; a
    sample that takes longer than SAMPLE_TIMEOUT_S to check scores 0."""
    global _checker
    if solution is None:
        raise ValueError(
            "rltrain.rewards.math:accuracy compares with the dataset's 'solution' column, which the data has not: "
            "name the column holding the answers with data.columns.solution=COLUMN (e.g. answer), or make one with data.map_fn"
        )
    if _checker is None:
        _checker = AnswerChecker()
    marker = current_end_marker()  # a reasoning model's answer follows its thinking
    return [_checker.score(answer_after_thinking(c, marker), s) for c, s in zip(completions, solution, strict=True)]
