"""Calls at once in a CallPool (rltrain.runtime.call_pool, `env.max_concurrency`): concurrency
proved by construction (calls that can only return once all of them have started, a barrier of
files across the worker processes), hung calls given up on together (N cost one timeout) while the
calls beside them run on undisturbed, and the calls in flight on a worker that died run again
instead of being lost. Real worker processes."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time

import pytest

from rltrain.runtime.call_pool import Call, CallPool

FIXTURES = textwrap.dedent('''
    import asyncio, os, time
    from pathlib import Path

    def barrier(folder, name, parties):
        """Returns only once `parties` calls have reached it (each leaves a file); else hangs."""
        Path(folder, name).write_text(str(os.getpid()))
        while len(list(Path(folder).iterdir())) < parties:
            time.sleep(0.01)
        return [name, os.getpid()]

    def waits(folder, name, release):
        """Leaves a file in `folder`, then returns once `release` exists."""
        Path(folder, name).write_text("")
        while not os.path.exists(release):
            time.sleep(0.01)
        return name

    def hangs():
        time.sleep(1000)

    async def blocks_its_loop():
        """A synchronous sleep inside async def: its event loop never runs again."""
        time.sleep(1000)

    async def awaits(seconds, value):
        await asyncio.sleep(seconds)
        return value

    def sleeps(seconds, value):
        time.sleep(seconds)
        return value

    def counted(log, seconds, value):
        """Adds a line to `log` each time it runs, then sleeps `seconds`."""
        with open(log, "a") as f:
            f.write("run\\n")
        time.sleep(seconds)
        return value
''')


@pytest.fixture
def module(tmp_path, monkeypatch) -> str:
    (tmp_path / "pool_fixtures.py").write_text(FIXTURES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "pool_fixtures"


def pool_of(module: str, workers: int, concurrency: int, *names: str) -> CallPool:
    return CallPool(workers, [f"{module}:{n}" for n in names], "test", concurrency)


@pytest.mark.parametrize("workers", [1, 3])
def test_calls_run_at_once_up_to_the_concurrency(module, tmp_path, workers):
    """12 calls that each wait for all 12 to start: they return only if the pool runs them at
    once (in threads of one worker, or spread over three); a pool of one call at a time cannot."""
    folder = tmp_path / "barrier"
    folder.mkdir()
    calls = [Call(f"{module}:barrier", {"folder": str(folder), "name": f"c{i}", "parties": 12}) for i in range(12)]
    pool = pool_of(module, workers, 12, "barrier")
    try:
        results = pool.run(calls, timeout_s=60.0)
    finally:
        pool.close()
    assert [r.failure for r in results] == [None] * 12
    assert [r.value[0] for r in results] == [f"c{i}" for i in range(12)]  # results in call order
    assert len({r.value[1] for r in results}) == workers

    (folder_serial := tmp_path / "serial").mkdir()
    serial = pool_of(module, 1, 1, "barrier")
    try:
        calls = [Call(f"{module}:barrier", {"folder": str(folder_serial), "name": f"c{i}", "parties": 2}) for i in range(2)]
        results = serial.run(calls, timeout_s=2.0)
    finally:
        serial.close()
    assert results[0].failure == "timeout"  # one at a time, the first waits alone until its time runs out


def test_n_hung_calls_cost_one_timeout_and_the_others_return(module):
    """10 calls hung in their threads and 4 async ones that block their event loops, beside calls
    that sleep or await: the hung ones fail together at one timeout (those that blocked their loop
    say so), the others return, their own event loops undisturbed by the blocked ones."""
    pool = pool_of(module, 1, 24, "hangs", "sleeps", "blocks_its_loop", "awaits")
    calls = (
        [Call(f"{module}:hangs", {}) for _ in range(10)] + [Call(f"{module}:blocks_its_loop", {}) for _ in range(4)]
        + [Call(f"{module}:sleeps", {"seconds": 0.1, "value": i}) for i in range(4)]
        + [Call(f"{module}:awaits", {"seconds": 0.5, "value": i}) for i in range(4)]
    )
    try:
        pool.start()
        started = time.monotonic()
        results = pool.run(calls, timeout_s=4.0)
        elapsed = time.monotonic() - started
    finally:
        pool.close()
    assert [r.failure for r in results[:14]] == ["timeout"] * 14
    assert ["blocked its event loop" in r.message for r in results[:14]] == [False] * 10 + [True] * 4
    assert [(r.failure, r.value) for r in results[14:]] == [(None, i) for i in range(4)] * 2
    assert elapsed < 10.0, elapsed  # one after another they would take 56 s


def test_a_call_in_flight_beside_a_hung_one_runs_on_undisturbed(module, tmp_path):
    """One worker, two slots: `hangs` and a 2 s call start together; the third call (3 s, within
    its own 4 s) starts when the 2 s one returns and is still running when the hung call's 4 s run
    out. The hung call fails and is left in its thread; the third runs on, once, and returns its
    value; the worker that holds the hung thread is killed once it runs nothing else, before `run`
    returns."""
    log = tmp_path / "log"
    pool = pool_of(module, 1, 2, "hangs", "sleeps", "counted")
    calls = [
        Call(f"{module}:hangs", {}),
        Call(f"{module}:sleeps", {"seconds": 2.0, "value": "a"}),
        Call(f"{module}:counted", {"log": str(log), "seconds": 3.0, "value": "b"}),
    ]
    try:
        pool.start()
        first = pool.workers[0].proc
        results = pool.run(calls, timeout_s=4.0)
        assert [(r.failure, r.value) for r in results] == [("timeout", None), (None, "a"), (None, "b")]
        assert log.read_text() == "run\n"  # one run: not cut off, not played again
        assert first.poll() is not None and pool.workers[0].proc is not first and not pool.retired
    finally:
        pool.close()


def test_a_worker_killed_with_calls_in_flight_loses_none_of_them(module, tmp_path):
    """SIGKILL the worker while 8 calls wait in it: each runs again, alone on a fresh worker (a call
    that crashed its worker takes no other with it the second time), and returns; a call whose
    worker is lost under it twice fails as "died", one result per call, never a silent loss."""
    folder, release = tmp_path / "started", tmp_path / "release"
    folder.mkdir()
    pool = pool_of(module, 1, 8, "waits")
    calls = [Call(f"{module}:waits", {"folder": str(folder), "name": f"c{i}", "release": str(release)}) for i in range(8)]

    def started(count: int) -> None:
        while len(list(folder.iterdir())) < count:
            time.sleep(0.01)
        for f in folder.iterdir():
            f.unlink()

    def kill() -> None:
        pid = pool.workers[0].proc.pid
        os.kill(pid, signal.SIGKILL)
        while pool.workers[0].proc.pid == pid:
            time.sleep(0.01)

    def kill_then_release(kills: int) -> None:
        started(8)
        kill()
        if kills == 2:  # the first call to run again (alone) loses its worker a second time
            started(1)
            assert len(pool.workers[0].tasks) == 1
            kill()
        release.write_text("")

    try:
        pool.start()
        for kills in (1, 2):
            release.unlink(missing_ok=True)
            for f in folder.iterdir():  # the files of the last round's reruns, all returned
                f.unlink()
            helper = threading.Thread(target=kill_then_release, args=(kills,), daemon=True)
            helper.start()
            results = pool.run(calls, timeout_s=60.0)
            helper.join(timeout=60.0)
            if kills == 1:
                assert [(r.failure, r.value) for r in results] == [(None, f"c{i}") for i in range(8)]
            else:
                assert [r.failure for r in results] == ["died"] + [None] * 7
                assert "ended its worker process" in results[0].message and [r.value for r in results[1:]] == [f"c{i}" for i in range(1, 8)]
    finally:
        pool.close()


def test_calls_sent_to_a_worker_that_died_idle_run_on_its_replacement(module):
    """A worker killed between two runs (its end-of-file not read yet): the next run's sends meet a
    broken pipe; the calls never reached it, so they run on the replacement, not counted as reruns."""
    pool = pool_of(module, 1, 4, "sleeps")
    try:
        assert pool.run([Call(f"{module}:sleeps", {"seconds": 0, "value": 0})], timeout_s=60.0)[0].value == 0
        dead = pool.workers[0].proc
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait()
        results = pool.run([Call(f"{module}:sleeps", {"seconds": 0, "value": v}) for v in range(4)], timeout_s=60.0)
        assert [(r.failure, r.value) for r in results] == [(None, v) for v in range(4)]
        assert pool.workers[0].proc.pid != dead.pid
    finally:
        pool.close()
