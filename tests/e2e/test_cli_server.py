"""`rollout=server` in real runs (docs/rollout-servers.md): GRPO over one spawned vLLM API server
(versions, parity, the server gone with the run) gives the rows it gives over two URL-given ones;
two trainer ranks over two servers generating one step ahead, single-turn and with env=agent (the
agents' endpoint served from the servers)."""

from __future__ import annotations

import math
import os
import re
import socket

import pytest
from cli import QUICK, ROOT, SMALL_MODEL, python, rltrain, train_rows

from rltrain.rollout.server.process import free_port

pytestmark = pytest.mark.e2e
# The tests of the session's pair of servers run on the worker that started them (docs/testing.md).
on_session_servers = pytest.mark.xdist_group("rollout_servers")

RUN = ["algo=grpo", *QUICK, *SMALL_MODEL, "algo.prompts_per_step=4", "algo.group_size=2", "rollout=server", "data.num_eval=8"]
# What differs between fleets by design: timings, memory, throughput, and the fleet's own size.
FLEET_KEYS = ("time/", "mem/", "perf/", "rollout/servers_up")


def compared(row: dict) -> set[str]:
    return {k for k in row if not k.startswith(FLEET_KEYS) and not k.endswith("tokens_per_s")}


def assert_versions(rows, k=0):
    for r in rows:
        version = max(0, r["step"] - 1 - k)
        assert r["rollout/version_min"] == r["rollout/version_max"] == version, r
        assert r["rollout/server_failures"] == 0 and r["sync/bytes"] > 0, r
        assert r["time/sync"] > 0 or k > 0, r  # k >= 1: the push runs on the engine's queue, measured when it ran


def spawned_server_run(run_dir) -> list[dict]:
    """GRPO over one server the run spawns: versions, parity, and the server gone with the run."""
    proc = rltrain(*RUN, "trainer.max_steps=2", "rollout.servers.spawn=1", run_dir=run_dir, timeout=600)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["rollout/servers_up"] for r in rows] == [1] * 2
    assert_versions(rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), rows
    pid = int(re.search(r"rltrain: rollout server http://127\.0\.0\.1:\d+ \(pid (\d+)", proc.stdout).group(1))
    assert not os.path.exists(f"/proc/{pid}"), "the spawned server outlived the run"
    return rows


def test_a_spawned_server_serves_the_run_and_goes_with_it(tmp_path):
    spawned_server_run(tmp_path / "spawned")


@pytest.mark.slow  # completions do not depend on the server: tests/unit/rollout/test_rollout_server.py, in make test
@on_session_servers
def test_a_spawned_server_and_two_given_ones_give_the_same_rows(rollout_servers, tmp_path):
    """The session's two URL-given servers give the spawned server's rows, as per-request seeds make
    samples server-independent."""
    one = spawned_server_run(tmp_path / "servers-1")
    run_dir = tmp_path / "servers-2"
    rltrain(*RUN, "trainer.max_steps=2", f"rollout.servers.urls=[{','.join(s.url for s in rollout_servers['servers'])}]",
            run_dir=run_dir, timeout=600)
    two = train_rows(run_dir)
    assert [r["rollout/servers_up"] for r in two] == [2] * 2
    assert_versions(two)
    for a, b in zip(one, two, strict=True):
        keys = compared(a)
        assert keys == compared(b)
        for key in keys:
            if key.startswith("rollout/logprob_diff"):  # the servers' batches differ: fp32 round-off
                assert math.isclose(a[key], b[key], abs_tol=1e-6), (key, a[key], b[key])
            else:
                assert a[key] == b[key], (key, a[key], b[key])


# env=agent (docs/agents.md): examples/openai_agent.py, its endpoint served from the servers.
AGENT = ["env=agent", "env.agent=openai_agent:run", "env.workers=2", "data.num_eval=4"]


@on_session_servers
# Plain GRPO is `slow`: env=agent's run is GRPO over the same servers, with the agents' endpoint beside it.
@pytest.mark.parametrize("overrides", [pytest.param([], id="grpo", marks=pytest.mark.slow), pytest.param(AGENT, id="agent")])
def test_two_trainer_ranks_over_two_servers_one_step_ahead(rollout_servers, tmp_path, overrides):
    """With env=agent every call of every episode of step t's batch is sampled by version
    max(0, t - 2) (the completions' versions, as the servers report them), the batch played whole
    on the engine's worker thread before the next push (docs/async.md)."""
    urls = ",".join(s.url for s in rollout_servers["servers"])
    run_dir = tmp_path / "m2-k1"
    rltrain(*RUN, *overrides, "trainer.max_steps=3", "trainer.nproc=2", "placement.max_staleness=1",
            f"rollout.servers.urls=[{urls}]", run_dir=run_dir, timeout=600, env={"PYTHONPATH": str(ROOT / "examples")})
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_versions(rows, k=1)
    assert all(r["rollout/servers_up"] == 2 for r in rows)
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4  # step 1 is on-policy: parity checked
    for r in rows if overrides else []:
        assert r["rollout/staleness_mean"] == r["rollout/staleness_max"] == min(r["step"] - 1, 1), r
        assert 1.0 <= r["env/turns_mean"] <= 4.0, r
        assert r["env/timeouts"] == r["env/errors"] == r["env/no_calls"] == 0.0, r
        assert r["reward/mean"] == pytest.approx(r["reward/env"]) == pytest.approx(r["reward/correct"] + r["reward/brief"]), r


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["placement.time_sharing=true"], "placement.time_sharing=false"), (["rollout=vllm"], "rollout=server is implied")],
)
def test_serve_refuses_what_the_run_would_refuse(overrides, message):
    """rollout=server is implied: time sharing is refused as a rollout=server run refuses it."""
    proc = python("-m", "rltrain.serve", "--port", str(free_port()), "algo=grpo", *QUICK, *overrides, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("rltrain: error: ") and "Traceback" not in proc.stderr


def test_serve_refuses_a_port_something_listens_on_before_loading_anything():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = python("-m", "rltrain.serve", "--port", str(port), "algo=grpo", *QUICK, timeout=120)
    assert proc.returncode == 2 and f"port {port} on 0.0.0.0 is taken" in proc.stderr and "--port N" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("rltrain: error: ") and "Traceback" not in proc.stderr


@pytest.mark.slow  # PPO/Megatron and LoRA with episodes over servers: the engine's calls are the same as GRPO's
@on_session_servers
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["algo=ppo", "backend=megatron"], id="ppo-megatron"),
        pytest.param(["algo=grpo", "model.lora.rank=8", "env=python", "env.cls=rltrain.envs.addition_with_retries:AdditionWithRetries",
                      "env.max_turns=2"], id="grpo-lora-env"),
    ],
)
def test_other_shapes_over_servers(rollout_servers, tmp_path, overrides):
    """PPO on Megatron; LoRA (the merged weights pushed) with multi-turn episodes: parity every step."""
    urls = ",".join(s.url for s in rollout_servers["servers"])
    run_dir = tmp_path / "run"
    rltrain(*RUN, *overrides, "trainer.max_steps=2", f"rollout.servers.urls=[{urls}]", run_dir=run_dir, timeout=600)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert_versions(rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), rows
