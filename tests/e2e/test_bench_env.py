"""scripts/bench_env.py's pool table runs (so the script cannot rot): every hung call is counted as
a timeout and the rest return. The training rows are measured by hand (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from cli import python

pytestmark = pytest.mark.e2e


def test_bench_env_prints_the_pool_table():
    proc = python("scripts/bench_env.py", "--pool-only", "--calls", "8", "--hung", "0,3", "--timeout", "1", timeout=120, warm=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.rsplit(None, 2) for line in proc.stdout.splitlines()[2:]]
    assert [(name, int(timeouts)) for name, _, timeouts in rows] == [("0 of 8 calls hang", 0), ("3 of 8 calls hang", 3)], proc.stdout
    no_hang, hung = (float(seconds) for _, seconds, _ in rows)
    assert no_hang >= 0 and hung >= 1.0, proc.stdout  # a call is declared hung only once its 1 s has passed
