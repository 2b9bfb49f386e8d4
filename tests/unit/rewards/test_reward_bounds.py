"""`reward.timeout_s` and empty slices (rltrain.rewards.score)."""

from __future__ import annotations

import threading
import time

import pytest

from rltrain.rewards import RewardFn, score
from rltrain.runtime.errors import UserError


def _fn(fn, timeout_s=None) -> RewardFn:
    return RewardFn(fn.__name__, f"tests:{fn.__name__}", fn, 1.0, timeout_s)


def test_a_hanging_reward_fails_with_its_name_and_limit():
    release = threading.Event()

    def stuck(prompts, completions, **_):
        release.wait()
        return [0.0] * len(completions)

    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"'tests:stuck' did not return within reward.timeout_s=0.3 s"):
        score([_fn(stuck, 0.3)], ["p"], ["c"], {})
    assert time.monotonic() - t0 < 5
    release.set()


def test_a_bounded_reward_returns_and_raises_as_before():
    def ok(prompts, completions, answer, **_):
        return [float(a == "1") for a in answer]

    def bad(prompts, completions, **_):
        raise KeyError("x")

    assert score([_fn(ok, 5)], ["p", "p"], ["a", "b"], {"answer": ["1", "2"]}) == {"ok": [1.0, 0.0]}
    with pytest.raises(UserError, match="'tests:bad' raised KeyError"):
        score([_fn(bad, 5)], ["p"], ["c"], {})


def test_an_empty_slice_calls_nothing():
    def never(prompts, completions, answer, **_):
        raise AssertionError("called on an empty slice")

    assert score([_fn(never), _fn(never, 5)], [], [], {}) == {"never": []}
