"""The suite's `xdist_group`s hold: under `pytest -n 2 --dist loadgroup` (the Makefile's command)
every test of a group runs on one worker, one after the other.

Tests that must not overlap rely on it (the separate-engine tests count rlsep-* directories), and
so do module-scoped engines built once per worker (docs/testing.md, "Start-up"). A pytest/xdist
pair that drops the group silently (pytest-dev/pytest-xdist#1386) fails here instead."""

from __future__ import annotations

import os
import subprocess
import sys

GROUPED = """
import os, time
import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("i", range(6))
def test_grouped(i, tmp_path_factory):
    with open(os.environ["GROUP_LOG"], "a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {i}\\n")
    time.sleep(0.05)  # a free worker would take the next test if the group were not one unit


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.05)
"""


def test_a_group_runs_on_one_worker_in_order(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    log = tmp_path / "workers.log"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "test_grouped.py"],
        cwd=tmp_path, env={**os.environ, "GROUP_LOG": str(log)}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [line.split() for line in log.read_text().splitlines()]
    assert [int(i) for _, i in runs] == list(range(6))
    assert len({worker for worker, _ in runs}) == 1, runs
