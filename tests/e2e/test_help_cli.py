"""`python -m rltrain --help` (and `-h`) prints rltrain's page and exits 0; Hydra's own flags stay
Hydra's (`--hydra-help`). What the page holds: tests/unit/preflight/test_command_help.py."""

from __future__ import annotations

import pytest
from cli import rltrain

pytestmark = pytest.mark.e2e


def test_help_is_rltrains_page_and_h_is_the_same():
    long, short = rltrain("--help", "algo=dpo"), rltrain("-h", "algo=dpo")
    assert long.returncode == 0 and long.stdout == short.stdout
    assert long.stdout.startswith("rltrain: post-train") and "[dpo]" in long.stdout
    assert "powered by Hydra" not in long.stdout and "_schema" not in long.stdout
    assert "Traceback" not in long.stderr + short.stderr


def test_hydra_help_stays_hydras():
    proc = rltrain("--hydra-help")
    assert proc.returncode == 0 and "Hydra" in proc.stdout and "--cfg" in proc.stdout
