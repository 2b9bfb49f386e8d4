"""In-flight updates over the server fleet (rltrain/rollout/server/stream.py, docs/async.md "Weights in
flight") against the session's real vLLM API servers: versions pushed while a server decodes a
group are taken between two of its decoding steps, the requests going on (each answered once, its
tokens before the load the ones the old weights sample alone), every token labelled with its
version; a server that fails mid-stream costs only its requests, sent whole to another. The span
parsing on its own, on hand-written answers."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from rltrain.config.group_options import ServerRolloutConfig, ServersConfig
from rltrain.rollout.base import SamplingSettings
from rltrain.rollout.inflight_schedule import Group
from rltrain.rollout.server.fleet import ServerFleetEngine
from rltrain.rollout.server.process import free_port
from rltrain.rollout.server.roster import Server
from rltrain.rollout.server.routing_wire import encode_routing
from rltrain.rollout.server.stream import fill
from rltrain.runtime.errors import UserError

pytestmark = [pytest.mark.xdist_group("rollout_servers")]

SEED, N = 11, 2
PROMPTS = [[1, 4 + i, 6] for i in range(4)]


def fleet(rollout_servers, tmp_path) -> ServerFleetEngine:
    cfg = ServerRolloutConfig(servers=ServersConfig(urls=[rollout_servers["servers"][0].url], start_timeout_s=60), timeout_s=60.0)
    return ServerFleetEngine(cfg, rollout_servers["model_dir"], dtype="float32", rank=0, cuda=False, log_dir=tmp_path)


def open_stream(engine: ServerFleetEngine, max_new_tokens: int) -> None:
    options = {
        "stream": False, "deterministic": False, "max_staleness": 1, "per_step": len(PROMPTS), "group_size": N,
        "lag_steps": 0, "version": 0, "first_step": 1, "expected_groups": len(PROMPTS),
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new_tokens, "stop_token_ids": []},
    }
    engine.request("stream_open", options=options)
    groups = [{"index": 100 + i, "step": 1, "position": i, "prompt_ids": p, "seed": SEED} for i, p in enumerate(PROMPTS)]
    engine.request("submit", groups=groups)


def test_versions_pushed_mid_generation_are_taken_between_decoding_steps(rollout_servers, tmp_path):
    engine = fleet(rollout_servers, tmp_path)
    longest = 400  # the tiny model's 512 positions, less the prompt: long enough for a push to land mid-sequence
    reference = engine.generate(PROMPTS, SamplingSettings(n=N, temperature=1.0, max_new_tokens=longest, seed=SEED))
    original = sorted(load_file(str(rollout_servers["model_dir"] / "model.safetensors")).items())
    scaled = [(n, t * 0.5 if "embed" in n else t) for n, t in original]
    server = engine.servers[0]
    served = server.served
    open_stream(engine, longest)
    deadline = time.monotonic() + 60
    while server.outstanding == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    for weights in (scaled, original, scaled):  # three versions while the groups decode
        time.sleep(0.05)
        if server.outstanding == 0:
            break
        engine.update_weights(iter(weights))
    taken = engine.request("take", step=1)
    assert [g["index"] for g in taken["groups"]] == [100, 101, 102, 103]
    assert server.served - served == len(PROMPTS) and engine.failures == 0  # one request per group, none sent again
    sequences = [(g, j) for g in taken["groups"] for j in range(N)]
    assert max(len(set(g["versions"][j])) for g, j in sequences) >= 2, "no version was loaded while a sequence decoded"
    diverged = 0
    for (g, j), expected in zip(sequences, reference, strict=True):
        tokens, versions = g["token_ids"][j], g["versions"][j]
        assert len(versions) == len(tokens) == len(g["logprobs"][j]) and versions == sorted(versions), versions
        assert set(versions) <= {0, 1, 2, 3}
        assert len(tokens) == longest or g["finished"][j]
        before = versions.count(0)  # the tokens version 0 sampled: the ones it samples alone, with the same seed
        assert tokens[:before] == expected.token_ids[:before]
        assert all(abs(a - b) < 1e-4 for a, b in zip(g["logprobs"][j][:before], expected.logprobs[:before], strict=True))
        diverged += tokens[before:] != expected.token_ids[before:len(tokens)]
    assert diverged > 0, "the tokens after a load are the old weights' samples"
    engine.close()


def test_a_server_failing_mid_stream_costs_only_its_requests(rollout_servers, tmp_path):
    """A second server that refuses every connection (it died) takes requests while the stream runs:
    each is marked down once and sent whole to the live server, and the batch is the one the live
    server gives alone."""
    engine = fleet(rollout_servers, tmp_path)
    reference = engine.generate(PROMPTS, SamplingSettings(n=N, temperature=1.0, max_new_tokens=16, seed=SEED))
    engine.servers.append(Server(f"http://127.0.0.1:{free_port()}"))  # nothing listens there
    open_stream(engine, 16)
    taken = engine.request("take", step=1)
    assert engine.failures == 1 and [s.up for s in engine.servers] == [True, False]
    got = [(g["token_ids"][j], g["versions"][j]) for g in taken["groups"] for j in range(N)]
    assert got == [(c.token_ids, [0] * len(c.token_ids)) for c in reference]
    assert engine.metrics()["rollout/version_max"] == 0.0
    engine.close()


def answer(spans: list[tuple[str, int, int]], tokens: int, server: str = "http://s:1") -> dict:
    return {
        "index": 0, "token_ids": list(range(tokens)), "finish_reason": "length", "server": server,
        "logprobs": {"content": [{"logprob": -0.5}] * tokens},
        "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in spans],
    }


def test_each_token_gets_the_version_of_its_span():
    group = Group(1, 0, 3, 0, [1, 2], 5, 1)
    fill(group, [answer([("2", 0, 3), ("3", 3, 5)], 5)], current=3)
    assert group.versions == [[2, 2, 2, 3, 3]] and group.done == 1 and group.finished == [False]
    fill(group, [answer([], 0)], current=3)  # an empty completion: no span, no token
    assert group.versions == [[]] and group.newest_version(3) == 3


def test_a_moe_groups_batch_route_answer_fills_its_log_probabilities_and_routing_record():
    """A MoE's group comes through rltrain's batch route (docs/moe.md, "Recording in a server"):
    flat log-probabilities and each choice's record, the record required with router replay."""
    record_TLK = torch.tensor([[[0, 7]], [[3, 1]]], dtype=torch.int16)
    compact = {**answer([("3", 0, 2)], 2), "logprobs": [-0.25, -1.5], "routing": encode_routing(record_TLK)}
    group = Group(1, 0, 3, 0, [1], 5, 1)
    fill(group, [compact], current=3, routing_required=True)
    assert group.logprobs == [[-0.25, -1.5]] and group.routing == [record_TLK.tolist()]
    with pytest.raises(UserError, match="returned no routing record") as raised:
        fill(group, [{**compact, "routing": None}], current=3, routing_required=True)
    assert "http://s:1" in str(raised.value)


@pytest.mark.parametrize(
    ("spans", "message"),
    [([("default", 0, 4)], r"weight version 'default'.*Give each run its own servers"),
     ([("4", 0, 4)], r"weight version '4'.*it holds version 3"),
     ([("3", 0, 2)], r"labelled 2 of 4 tokens")],
)
def test_a_token_of_a_version_never_pushed_stops_the_run_naming_the_server(spans, message):
    with pytest.raises(UserError, match=message) as raised:
        fill(Group(1, 0, 3, 0, [1], 5, 1), [answer(spans, 4, "http://elsewhere:8000")], current=3)
    assert "http://elsewhere:8000" in str(raised.value)


def test_prompts_held_for_a_version_enter_once_it_is_pushed(rollout_servers, tmp_path):
    """Without streaming, step 3's prompts (k = 1) enter only once version 1 is loaded: the fleet's
    stream holds them until the push, then they run under it."""
    engine = fleet(rollout_servers, tmp_path)
    open_stream(engine, 4)
    engine.request("submit", groups=[{"index": 200 + i, "step": 3, "position": i, "prompt_ids": p, "seed": SEED}
                                     for i, p in enumerate(PROMPTS)])
    engine.request("take", step=1)
    assert engine.stream is not None and len(engine.stream.backlog) == len(PROMPTS)  # step 3's: held back
    engine.update_weights(iter(sorted(load_file(str(rollout_servers["model_dir"] / "model.safetensors")).items())))
    taken = engine.request("take", step=3)
    assert {v for g in taken["groups"] for vs in g["versions"] for v in vs} == {1}
    engine.close()
