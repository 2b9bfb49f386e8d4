"""Interpreter start-up of the processes a warm test run starts (docs/testing.md, "Warm ranks").

This directory is on PYTHONPATH only there (tests/stand_in.py `environment`), so Python's `site`
imports this module in each of them before it runs their command: a process that an rltrain launcher
started becomes a stand-in for one forked by the rank server (tests/stand_in.py); any other runs on
untouched. tests/stand_in.py is loaded by its path, so nothing of tests/ lands on the process's
sys.path.
"""

import os
import sys


def _may_be_launched_by_rltrain() -> bool:
    """Only a `python -m rltrain...` can be a stand-in: any other process skips loading the stand-in
    (tens of milliseconds). At start-up `-m`'s sys.argv is ["-m", *args]."""
    return sys.argv[:1] == ["-m"] and sys.orig_argv[-len(sys.argv)].startswith("rltrain")


if os.environ.get("RLTRAIN_RANK_SERVER") and _may_be_launched_by_rltrain():
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "stand_in", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stand_in.py"))
    assert _spec is not None and _spec.loader is not None
    _stand_in = sys.modules["stand_in"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_stand_in)
    _stand_in.stand_in_if_launched()
