"""`make fault-suite` as a test (marked `slow`: `make test-all` runs it, `make test` does not).

scripts/fault_suite.py runs every `debug.fault` kind on both backends and 2 ranks, a killed rollout
child, a killed weight receiver and a lost sync message, agents blocked on one prompt in eight,
the `rollout=server` faults, the in-flight ones (a trainer and a server killed mid-stream), prints
the table docs/failure-behaviour.md shows, and exits 1 when a row breaks its promise: a fault not recovered or not counted, an exit that took too
long or never came, a file left in /dev/shm.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_every_fault_recovers_or_exits_in_bounded_time(tiny_cache):
    proc = subprocess.run([sys.executable, "scripts/fault_suite.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| `")]
    assert len(rows) == 34
    assert all(line.rstrip().endswith("| 0 |") for line in rows), "a run left files in /dev/shm"
