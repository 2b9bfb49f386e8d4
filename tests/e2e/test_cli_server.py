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

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("rollout_servers")]

RUN = ["algo=grpo", *QUICK, *SMALL_MODEL, "algo.prompts_per_step=4", "algo.group_size=2", "rollout=server"]
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


def test_a_spawned_server_and_two_given_ones_give_the_same_rows(rollout_servers, tmp_path):
    """One server the run spawns (versions, parity, the server gone with the run) and the session's
    two URL-given servers: the same rows, as per-request seeds make samples server-independent."""
    runs = {}
    for n, where in ((1, "rollout.servers.spawn=1"), (2, f"rollout.servers.urls=[{','.join(s.url for s in rollout_servers['servers'])}]")):
        run_dir = tmp_path / f"servers-{n}"
        proc = rltrain(*RUN, "trainer.max_steps=2", where, run_dir=run_dir, timeout=600)
        runs[n] = train_rows(run_dir)
        assert [r["step"] for r in runs[n]] == [1, 2]
        assert [r["rollout/servers_up"] for r in runs[n]] == [n] * 2
        assert_versions(runs[n])
        assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in runs[n]), runs[n]
        if n == 1:
            pid = int(re.search(r"rltrain: rollout server http://127\.0\.0\.1:\d+ \(pid (\d+)", proc.stdout).group(1))
            assert not os.path.exists(f"/proc/{pid}"), "the spawned server outlived the run"
    for one, two in zip(runs[1], runs[2], strict=True):
        keys = compared(one)
        assert keys == compared(two)
        for key in keys:
            if key.startswith("rollout/logprob_diff"):  # the servers' batches differ: fp32 round-off
                assert math.isclose(one[key], two[key], abs_tol=1e-6), (key, one[key], two[key])
            else:
                assert one[key] == two[key], (key, one[key], two[key])


# env=agent (docs/agents.md): examples/openai_agent.py, its endpoint served from the servers.
AGENT = ["env=agent", "env.agent=openai_agent:run", "env.workers=2", "data.num_eval=4"]


@pytest.mark.parametrize("overrides", [pytest.param([], id="grpo"), pytest.param(AGENT, id="agent")])
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
