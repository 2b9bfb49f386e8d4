"""Reward functions in killable workers (rltrain.rewards.scoring, rltrain.runtime.call_pool): a
chunk that hangs, raises, returns nonsense or kills its process costs its own samples, which score
`reward.on_failure` and are counted; more than `reward.max_failure_frac` failing stops the rank
with a UserError naming the function; an empty slice calls nothing. Real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

from rltrain.rewards.scoring import RewardFn, RewardScorer, checked_values, chunk_bounds
from rltrain.runtime.call_pool import CallResult
from rltrain.runtime.errors import UserError

FIXTURES = textwrap.dedent('''
    import os, subprocess, time

    def exact(prompts, completions, answer, **_):
        return [float(c == a) for c, a in zip(completions, answer)]

    def hangs_on_x(prompts, completions, **_):
        if "x" in completions:
            time.sleep(1000)
        return [1.0] * len(completions)

    def raises_on_x(prompts, completions, **_):
        if "x" in completions:
            raise KeyError("no such thing")
        return [1.0] * len(completions)

    def dies_on_x(prompts, completions, **_):
        if "x" in completions:
            os._exit(7)
        return [1.0] * len(completions)

    def short_on_x(prompts, completions, **_):
        return [1.0] * (len(completions) - ("x" in completions))

    def always_raises(prompts, completions, **_):
        raise ValueError("broken")

    def starts_a_sleeper_and_hangs(prompts, completions, marker, **_):
        subprocess.Popen(["sleep", marker[0]])
        time.sleep(1000)

    def numpy_floats(prompts, completions, **_):
        import numpy
        return numpy.ones(len(completions), dtype=numpy.float32)

    def sees_its_images(prompts, completions, images, image, blob, **_):
        from PIL import Image
        def red(im):
            return isinstance(im, Image.Image) and im.mode == "RGB" and im.getpixel((0, 0)) == (200, 0, 0)
        return [float(all(map(red, ims)) and red(one) and b == b"\\x00\\xff") for ims, one, b in zip(images, image, blob)]

    def pid(prompts, completions, **_):
        time.sleep(0.3)  # long enough for the second worker to be ready and take a share
        return [float(os.getpid())] * len(completions)
''')


@dataclass
class Cfg:
    timeout_s: float | None = 2.0
    workers: int = 1
    chunk_size: int = 0
    chunk_spans_groups: bool = False
    on_failure: float = -1.0
    max_failure_frac: float = 0.5


@pytest.fixture
def rewards_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "rw_fixtures.py").write_text(FIXTURES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rw_fixtures"


def scorer(*names: str, module: str, cfg: Cfg | None = None, budget_s: float = 600) -> RewardScorer:
    import importlib

    fns = [RewardFn(n, f"{module}:{n}", getattr(importlib.import_module(module), n), 1.0) for n in names]
    return RewardScorer(fns, cfg or Cfg(), collective_timeout_s=2 * budget_s)


def groups_of(n_prompts: int, size: int) -> list[int]:
    return [p for p in range(n_prompts) for _ in range(size)]


def test_chunks_are_one_group_or_at_most_chunk_size_of_one_group():
    groups = [0, 0, 0, 1, 1, 2]
    assert chunk_bounds(groups, 0, False) == [(0, 3), (3, 5), (5, 6)]
    assert chunk_bounds(groups, 2, False) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert chunk_bounds(groups, 1, False) == [(i, i + 1) for i in range(6)]
    assert chunk_bounds(groups, 4, True) == [(0, 4), (4, 6)]
    assert chunk_bounds(groups, 0, True) == [(0, 6)]
    assert chunk_bounds([], 0, False) == []


def test_checked_values_name_what_is_wrong():
    assert checked_values(CallResult(value=[1, 0.5]), 2, 3) == ([1.0, 0.5], "", "")
    assert checked_values(CallResult(failure="timeout"), 2, 3)[1:] == ("timeout", "did not return within reward.timeout_s=3 s")
    assert checked_values(CallResult(failure="error", message="KeyError: 'a'"), 2, 3)[1:] == ("error", "raised KeyError: 'a'")
    assert "exactly one per completion" in checked_values(CallResult(value=[1.0]), 2, 3)[2]
    assert "non-finite" in checked_values(CallResult(value=[1.0, float("nan")]), 2, 3)[2]
    assert "list of floats" in checked_values(CallResult(value="ab"), 2, 3)[2]


def test_worker_scores_equal_a_direct_call_and_an_empty_slice_calls_nothing(rewards_module):
    s = scorer("exact", module=rewards_module)
    try:
        per_fn, failures = s.score(["p"] * 4, ["1", "2", "3", "4"], {"answer": ["1", "0", "3", "0"]}, groups_of(2, 2))
        assert per_fn == {"exact": [1.0, 0.0, 1.0, 0.0]} and failures.timeouts == failures.errors == 0
        assert s.score([], [], {}, [])[0] == {"exact": []}
        with pytest.raises(UserError, match="cannot be sent to its worker: set is not JSON-serialisable"):
            s.score(["p"], ["1"], {"answer": [{"1"}]}, [0])  # calls and results cross as JSON, not pickle
    finally:
        s.close()
    s = scorer("numpy_floats", module=rewards_module)
    try:
        assert s.score(["p"] * 2, ["a", "b"], {}, [0, 0])[0] == {"numpy_floats": [1.0, 1.0]}
    finally:
        s.close()


def test_a_rows_images_and_bytes_reach_the_worker_as_pil_images_and_bytes(rewards_module):
    from PIL import Image

    red = Image.new("RGB", (28, 28), (200, 0, 0))
    s = scorer("sees_its_images", module=rewards_module)
    try:
        columns = {"images": [[red, red], [red]], "image": [red, red], "blob": [b"\x00\xff", b"\x00\xff"]}
        assert s.score(["p", "p"], ["a", "b"], columns, [0, 0])[0] == {"sees_its_images": [1.0, 1.0]}
        blue = Image.new("RGB", (28, 28), (0, 0, 200))
        assert s.score(["p"], ["a"], {"images": [[blue]], "image": [red], "blob": [b"\x00\xff"]}, [0])[0] == {"sees_its_images": [0.0]}
    finally:
        s.close()


@pytest.mark.parametrize(
    "fn, kind, problem",
    [
        ("hangs_on_x", "timeouts", "did not return within reward.timeout_s=2 s"),
        ("raises_on_x", "errors", "raised KeyError: 'no such thing'"),
        ("dies_on_x", "errors", r"ended its worker process \(exit status 7\)"),
        ("short_on_x", "errors", "returned 1 rewards for 2 completions"),
    ],
)
def test_a_failing_chunk_costs_its_own_samples_and_the_run_goes_on(rewards_module, fn, kind, problem):
    """Three groups of two; the middle one fails. Its samples score on_failure, the others are
    scored, the failure is counted, and the replaced worker scores the next step."""
    s = scorer(fn, module=rewards_module, cfg=Cfg(max_failure_frac=0.5))
    completions = ["a", "b", "x", "c", "d", "e"]
    try:
        t0 = time.monotonic()
        per_fn, failures = s.score(["p"] * 6, completions, {}, groups_of(3, 2))
        assert time.monotonic() - t0 < 30
        assert per_fn[fn] == [1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
        assert (failures.timeouts, failures.errors) == ((2, 0) if kind == "timeouts" else (0, 2))
        assert s.score(["p"] * 2, ["a", "b"], {}, groups_of(1, 2))[0][fn] == [1.0, 1.0]  # a fresh worker
        # Failing for more than max_failure_frac of a step's samples stops the rank, naming the function.
        with pytest.raises(UserError, match=rf"reward function '{rewards_module}:{fn}' {problem}.*on 2 of the 2 samples"):
            s.score(["p"] * 2, ["x", "y"], {}, groups_of(1, 2))
    finally:
        s.close()


def test_a_broken_function_stops_the_rank_with_its_error(rewards_module):
    s = scorer("always_raises", module=rewards_module, cfg=Cfg(max_failure_frac=0.25))
    try:
        with pytest.raises(UserError, match=r"'rw_fixtures:always_raises' raised ValueError: broken \(on 4 of the 4"):
            s.score(["p"] * 4, list("abcd"), {}, groups_of(2, 2))
    finally:
        s.close()


def test_a_timeout_kills_what_the_function_started(rewards_module):
    marker = f"{1000 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"  # a `sleep` argument no other process has
    s = scorer("starts_a_sleeper_and_hangs", module=rewards_module, cfg=Cfg(timeout_s=1.0, max_failure_frac=1.0))
    try:
        per_fn, failures = s.score(["p"], ["a"], {"marker": [marker]}, [0])
        assert failures.timeouts == 1 and per_fn["starts_a_sleeper_and_hangs"] == [-1.0]
        time.sleep(0.5)
        listing = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
        assert f"sleep {marker}" not in listing
    finally:
        s.close()


def test_the_step_budget_ends_scoring_even_when_every_call_would_fit_its_timeout(rewards_module):
    """Half the collective timeout bounds a rank's whole scoring: its peers never wait into it."""
    s = scorer("hangs_on_x", module=rewards_module, cfg=Cfg(timeout_s=100, max_failure_frac=1.0), budget_s=3)
    try:
        t0 = time.monotonic()
        per_fn, failures = s.score(["p"] * 4, ["x", "x", "a", "b"], {}, groups_of(2, 2))
        assert time.monotonic() - t0 < 20
        assert per_fn["hangs_on_x"] == [-1.0] * 4 and failures.timeouts == 4  # the second chunk never got to run
    finally:
        s.close()


def test_workers_share_the_calls_and_die_with_the_trainer(rewards_module, tmp_path):
    s = scorer("pid", module=rewards_module, cfg=Cfg(workers=2))
    try:
        per_fn, _ = s.score(["p"] * 8, list("abcdefgh"), {}, groups_of(8, 1))
        assert len(set(per_fn["pid"])) == 2 and os.getpid() not in per_fn["pid"]
    finally:
        s.close()
    # A SIGKILLed trainer cannot close its pool: the kernel ends the workers (PR_SET_PDEATHSIG).
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        from rltrain.runtime.call_pool import Call, CallPool
        pool = CallPool(2, ["rw_fixtures:pid"], "test")
        print(*(int(r.value[0]) for r in pool.run([Call("rw_fixtures:pid", {{"prompts": ["p"], "completions": ["c"]}})] * 4, 30)), flush=True)
        time.sleep(1000)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout is not None
    workers = {int(p) for p in trainer.stdout.readline().split()}
    assert workers and trainer.pid not in workers
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in workers), "a worker outlived its SIGKILLed trainer"
