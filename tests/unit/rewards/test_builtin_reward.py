"""The built-in addition reward pays most for the exact answer, so RL cannot win by shape alone."""

from __future__ import annotations

import pytest

from rltrain.rewards.builtin import addition_reward


def score(completion: str, answer: str = "57") -> float:
    return addition_reward(["25+32="], [completion], [answer])[0]


def test_the_exact_answer_scores_one_and_beats_every_near_miss():
    assert score("57") == pytest.approx(1.0)
    assert score(" 57 ") == pytest.approx(1.0)
    for near_miss in ("56", "58", "570", "5", "57x"):
        assert score(near_miss) < 0.5


def test_the_shaped_half_still_grades_wrong_answers():
    assert score("abcdefg") == 0.0
    assert 0 < score("9") < score("90") < score("60") < score("56")
