"""`rollout=server`'s config checks (rltrain/preflight/validate_rl.py, docs/rollout-servers.md): each
refusal is one paragraph naming the fix, before anything is built."""

from __future__ import annotations

import pytest

from rltrain.preflight.validate import validate
from rltrain.runtime.errors import UserError
from rltrain.serve import compose_run_config

BASE = ["algo=grpo", "model=tiny", "rollout=server"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.servers.spawn=1", "placement.time_sharing=true"], r"placement\.time_sharing=false"),
        ([], r"rollout\.servers\.spawn=N"),
        (["rollout.servers.urls=[localhost:8000]"], r"base URL such as http://"),
        (["rollout.servers.spawn=1", "rollout.timeout_s=0"], r"rollout\.timeout_s=0\.0 must be positive"),
        (["rollout.servers.spawn=1", "rollout.servers.push_backend=mpi"], r"push_backend='mpi' is not one of auto, gloo, nccl"),
    ],
)
def test_refused_with_the_fix(overrides, message):
    with pytest.raises(UserError, match=message):
        validate(compose_run_config([*BASE, *overrides]))


def test_a_fleet_generates_ahead_and_spawned_or_given_servers_pass():
    validate(compose_run_config([*BASE, "rollout.servers.spawn=2", "placement.max_staleness=1"]))
    validate(compose_run_config([*BASE, "rollout.servers.urls=[http://10.0.0.2:8000,http://10.0.0.3:8000]"]))
    validate(compose_run_config([*BASE, "rollout.servers.urls=[http://10.0.0.2:8000]", "rollout.servers.push_backend=nccl"]))
