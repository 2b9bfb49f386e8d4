"""The math reward (rltrain.rewards.math) on real-world answer pairs, and its per-sample bound: a
check that hangs costs its own sample (0) and a killed worker, then checking goes on."""

from __future__ import annotations

import time

import pytest

from rltrain.rewards.math import AnswerChecker, accuracy, final_solution

# (completion, solution, reward)
PAIRS = [
    ("The total is 1,000 apples.", "1000", 1.0),  # an integer with a comma
    ("So the answer is 1000", "1,000", 1.0),
    ("Therefore \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # LaTeX boxed fraction vs a decimal
    ("so x = 3/4", "\\frac{3}{4}", 1.0),  # a plain fraction vs LaTeX
    ("She pays 12.50 dollars.", "12.5", 1.0),  # a decimal with a trailing zero and a unit
    ("It is 3 cm long.", "3", 1.0),  # a unit
    ("Natalia sold 72 clips.", "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", 1.0),  # GSM8K
    ("48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72", "#### 72", 1.0),  # a completion in GSM8K's own format
    ("The answer is 41.", "42", 0.0),  # a wrong answer that looks close
    ("0.333", "\\frac{1}{3}", 0.0),  # a rounded fraction is not the fraction
    ("I do not know.", "7", 0.0),  # no answer at all
]


def test_a_table_of_real_world_answers():
    completions, solutions, expected = zip(*PAIRS, strict=True)
    assert accuracy(["q"] * len(PAIRS), list(completions), list(solutions)) == list(expected)


def test_a_gsm8k_solution_counts_from_its_last_mark():
    assert final_solution("3 + 4 = 7\n#### 7") == "7" and final_solution("\\frac{1}{2}") == "\\frac{1}{2}"


def hang(completion: str, solution: str) -> float:
    """A check that never returns on "hang" (the pathological sympy input stand-in)."""
    if completion == "hang":
        time.sleep(600)
    return 1.0


def test_a_hanging_check_costs_its_sample_not_the_step():
    checker = AnswerChecker(check_path=f"{__name__}:hang", timeout_s=1.0)
    try:
        assert checker.score("fine", "1") == 1.0  # the worker is up
        first = checker.process
        started = time.monotonic()
        assert checker.score("hang", "1") == 0.0
        assert time.monotonic() - started < 10
        assert checker.timeouts == 1 and not first.is_alive()  # killed, not left running
        assert checker.score("fine", "1") == 1.0  # a new worker takes the next sample
    finally:
        checker.close()


@pytest.mark.parametrize("bad", ["\\frac{", "$$$", "x" * 5000])
def test_unparseable_answers_score_zero_without_an_error(bad):
    assert accuracy(["q"], [bad], ["5"]) == [0.0]


def test_data_without_a_solution_column_is_told_how_to_map_one():
    with pytest.raises(ValueError, match="data.columns.solution=COLUMN"):
        accuracy(["q"], ["1"])
