"""`rollout=server` against two real vLLM API servers on the CPU (the session's `rollout_servers`):
completions independent of the fleet, weights pushed to every server with their version on every
completion, a server SIGKILLed mid-generation and restarted, another model refused, every server
gone, two URLs of one server refused, a server that fails while the fleet forms survived.
docs/rollout-servers.md."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from safetensors.torch import load_file

from rltrain.config.group_options import ServerRolloutConfig, ServersConfig
from rltrain.rollout.base import SamplingSettings
from rltrain.rollout.server.client import BATCH_PATH, LOAD_PATH, ServerRefused, call
from rltrain.rollout.server.fleet import FleetDown, ServerFleetEngine
from rltrain.rollout.server.process import SpawnedServer, free_port
from rltrain.rollout.server.push import server_device
from rltrain.rollout.server.roster import server_push_backend
from rltrain.runtime.errors import UserError

pytestmark = [pytest.mark.xdist_group("rollout_servers")]

PROMPTS = [[1, 5 + i, 7, 9 + (i % 3)] for i in range(8)]
SAMPLING = SamplingSettings(n=2, temperature=1.0, max_new_tokens=12, seed=3)


def fleet(rollout_servers, indices, tmp_path, model_dir=None, timeout_s=60.0, push_backend="auto", urls=()) -> ServerFleetEngine:
    urls = [rollout_servers["servers"][i].url for i in indices] + list(urls)
    cfg = ServerRolloutConfig(servers=ServersConfig(urls=urls, start_timeout_s=60, push_backend=push_backend), timeout_s=timeout_s)
    return ServerFleetEngine(
        cfg, model_dir or rollout_servers["model_dir"], dtype="float32", rank=0, cuda=False, log_dir=tmp_path
    )


def rows(completions):
    """What a completion is: its prompt, its tokens, where it stopped. (The log-probabilities
    depend on the server's batch at fp32 round-off, compared by `logprobs_close`.)"""
    return [(c.prompt_index, c.token_ids, c.finished) for c in completions]


def logprobs_close(a, b) -> bool:
    return all(
        len(x.logprobs) == len(y.logprobs) and all(abs(p - q) < 1e-5 for p, q in zip(x.logprobs, y.logprobs))
        for x, y in zip(a, b, strict=True)
    )


def checkpoint(model_dir):
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def test_completions_do_not_depend_on_which_server_served_them(rollout_servers, tmp_path):
    one = fleet(rollout_servers, [0], tmp_path)
    alone = one.generate(PROMPTS, SAMPLING)
    two = fleet(rollout_servers, [0, 1], tmp_path)
    spread = two.generate(PROMPTS, SAMPLING)
    assert rows(spread) == rows(alone) and logprobs_close(spread, alone)
    assert [c.prompt_index for c in spread] == [i for i in range(len(PROMPTS)) for _ in range(2)]
    # One request per server and batch (rollout/server/batch_route.py), each with half the prompts.
    assert [s.served for s in one.servers] == [1] and [s.served for s in two.servers] == [1, 1], [s.served for s in two.servers]
    assert one.metrics()["rollout/servers_up"] == 1.0 and two.metrics()["rollout/servers_up"] == 2.0
    assert {c.version for c in spread} == {0}


def test_the_batch_route_answers_as_vllms_own_generate_does_per_prompt(rollout_servers):
    """The batch route reads vLLM's outputs itself (rollout/server/batch_route.py): each entry's
    choices are those vLLM's own `/inference/v1/generate` answers for the same body (the same
    seeds, defaults and stops); a malformed batch or load is refused (HTTP 400), naming what is wrong."""
    url = rollout_servers["servers"][0].url
    bodies = [
        {"token_ids": prompt, "sampling_params": {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 12, "seed": 40 + i,
                                                  "stop_token_ids": [9, 11], "logprobs": 0, "detokenize": False}}
        for i, prompt in enumerate(PROMPTS[:4])
    ]
    answers = call(url, BATCH_PATH, {"requests": bodies}, 60)["answers"]
    assert len(answers) == len(bodies)
    for body, answer in zip(bodies, answers, strict=True):
        own = call(url, "/inference/v1/generate", body, 60)
        ours = sorted(answer["choices"], key=lambda c: c["index"])
        theirs = sorted(own["choices"], key=lambda c: c["index"])
        assert [(c["index"], c["token_ids"], c["finish_reason"], c["weight_versions"]) for c in ours] == [
            (c["index"], c["token_ids"], c["finish_reason"], c["weight_versions"]) for c in theirs
        ]
        for mine, vllms in zip(ours, theirs, strict=True):
            expected = [entry["logprob"] for entry in vllms["logprobs"]["content"]]
            assert len(mine["logprobs"]) == len(expected) and all(abs(a - b) < 1e-5 for a, b in zip(mine["logprobs"], expected))
    with pytest.raises(ServerRefused, match="HTTP 400.*token_ids"):
        call(url, BATCH_PATH, {"requests": [{"token_ids": [], "sampling_params": {}}]}, 60)
    with pytest.raises(ServerRefused, match="HTTP 400.*manifest"):
        call(url, LOAD_PATH, {"version": "1"}, 60)

def test_a_burst_beyond_one_engine_step_is_sampled_without_chunked_prefills(rollout_servers, tmp_path):
    """More prompt tokens at once than one engine step takes (64 prompts x 8 samples x 41 tokens):
    a CPU server that prefilled a seeded request in chunks would rewind its generator, which the
    CPU build cannot, and its engine would die (HTTP 500 on every request after)."""
    engine = fleet(rollout_servers, [0], tmp_path)
    prompts = [[1, *range(5 + i % 7, 45 + i % 7)] for i in range(64)]
    out = engine.generate(prompts, SamplingSettings(n=8, temperature=1.0, max_new_tokens=2, seed=5))
    assert len(out) == 64 * 8 and {c.prompt_index for c in out} == set(range(64))
    assert engine.metrics()["rollout/server_failures"] == 0.0, [s.reasons for s in engine.servers]


def test_pushed_weights_reach_every_server_with_their_version(rollout_servers, tmp_path):
    engine = fleet(rollout_servers, [0, 1], tmp_path)
    before = engine.generate(PROMPTS, SAMPLING)
    weights = checkpoint(rollout_servers["model_dir"])
    scaled = [(n, t * 0.5 if "embed" in n else t) for n, t in weights]
    engine.update_weights(iter(scaled))
    changed = engine.generate(PROMPTS, SAMPLING)
    assert {c.version for c in changed} == {1}
    assert rows(changed) != rows(before)
    # Each server alone at version 1 samples what the fleet sampled: both hold the pushed weights.
    for server in engine.servers:
        others = [s for s in engine.servers if s is not server]
        for other in others:
            other.up = False
        assert rows(engine.generate(PROMPTS, SAMPLING)) == rows(changed)
        for other in others:
            other.up = True
    engine.update_weights(iter(weights))
    restored = engine.generate(PROMPTS, SAMPLING)
    assert rows(restored) == rows(before) and {c.version for c in restored} == {2}


def test_a_server_left_paused_by_a_killed_trainer_serves_the_next_fleet(rollout_servers, tmp_path):
    """An in-flight push pauses the server (push.py); a trainer SIGKILLed before its resume left it
    holding every request, so the resumed run's first batch waited forever. Joining resumes it."""
    from rltrain.rollout.server.client import call

    url = rollout_servers["servers"][0].url
    call(url, "/pause?mode=keep&clear_cache=false", {}, 30)
    assert call(url, "/is_paused", None, 30)["is_paused"] is True
    engine = fleet(rollout_servers, [0], tmp_path, timeout_s=30.0)
    assert call(url, "/is_paused", None, 30)["is_paused"] is False
    assert len(engine.generate(PROMPTS[:2], SAMPLING)) == 4


def test_a_server_killed_mid_generation_is_survived_and_gets_the_weights_back(rollout_servers, tmp_path):
    engine = fleet(rollout_servers, [0, 1], tmp_path)
    weights = [(n, t * 0.5 if "embed" in n else t) for n, t in checkpoint(rollout_servers["model_dir"])]
    engine.update_weights(iter(weights))
    sampling = SamplingSettings(n=2, temperature=1.0, max_new_tokens=96, seed=5)
    prompts = [[1, 4 + i, 6] for i in range(16)]
    victim = rollout_servers["servers"][1]

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 60
        while engine.servers[1].outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.killpg(victim.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    survived = engine.generate(prompts, sampling)
    killer.join()
    assert engine.metrics()["rollout/server_failures"] == 1.0
    assert engine.metrics()["rollout/servers_up"] == 1.0
    reference = fleet(rollout_servers, [0], tmp_path)  # server 0 alone, the same version
    reference.update_weights(iter(weights))
    expected = reference.generate(prompts, sampling)
    assert rows(survived) == rows(expected) and logprobs_close(survived, expected)
    # Back at the same URL (a fresh process with the checkpoint's weights): it is given version 1
    # before it serves again, so the fleet's samples stay those of version 1.
    victim.stop()
    revived = SpawnedServer(rollout_servers["cfg"], rollout_servers["model_dir"], "float32", False,
                            rollout_servers["logs"] / "server-1-again.log", port=victim.port)
    rollout_servers["servers"][1] = revived
    revived.wait_ready(600)
    again = engine.generate(prompts, sampling)
    assert engine.metrics()["rollout/servers_up"] == 2.0 and engine.servers[1].served > 0
    assert rows(again) == rows(survived) and logprobs_close(again, survived)


def test_a_server_of_another_model_is_refused_naming_the_difference(rollout_servers, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(rollout_servers["model_dir"], other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"tokenizer_config\.json differs") as info:
        fleet(rollout_servers, [0], tmp_path, model_dir=other)
    assert rollout_servers["servers"][0].url in str(info.value)


def test_every_server_gone_stops_within_the_timeout_naming_them(rollout_servers, tmp_path):
    engine = fleet(rollout_servers, [0], tmp_path, timeout_s=3.0)
    gone = f"http://127.0.0.1:{free_port()}"
    engine.servers[0].url = gone  # the server vanished: nothing listens there any more
    started = time.monotonic()
    with pytest.raises(FleetDown, match="every rollout server stayed unreachable") as info:
        engine.generate(PROMPTS, SAMPLING)
    assert time.monotonic() - started < 3.0 + 5.0
    assert gone in str(info.value) and engine.metrics()["rollout/server_failures"] == 1.0


def test_updates_on_other_ranks_count_versions_without_pushing(rollout_servers, tmp_path):
    """Trainer ranks other than 0 consume the export (a collective) and wait for rank 0's version."""
    engine = fleet(rollout_servers, [0], tmp_path, timeout_s=2.0)
    engine.rank = 1
    engine.update_weights(iter(checkpoint(rollout_servers["model_dir"])))
    assert engine.version == 1 and engine.current is None
    with pytest.raises(FleetDown, match="still not at version 1"):  # no rank 0 here: the server stays at version 0
        engine.generate(PROMPTS[:1], SAMPLING)


def test_cpu_servers_are_pushed_over_gloo_and_nccl_is_refused_naming_the_fix(rollout_servers, tmp_path):
    """The worker reports its device before any pair group opens: CPU servers join over gloo under
    `auto`; `nccl` is refused (exit 2) naming the server, from a CPU trainer and from a CUDA one."""
    url = rollout_servers["servers"][0].url
    assert server_device(url, 60.0) == "cpu"
    engine = fleet(rollout_servers, [0], tmp_path)
    assert engine.servers[0].pusher is not None and engine.servers[0].pusher.backend == "gloo"
    with pytest.raises(UserError, match=r"the trainer runs on the CPU.*rollout\.servers\.push_backend=gloo") as info:
        fleet(rollout_servers, [0], tmp_path, push_backend="nccl")
    assert url in str(info.value)
    engine.cfg.servers.push_backend = "nccl"  # what a CUDA trainer asks of this CPU server
    with pytest.raises(UserError, match=rf"{url} runs its model on cpu.*rollout\.servers\.push_backend=gloo"):
        server_push_backend(engine.servers[0], engine.cfg, cuda=True)
    engine.cfg.servers.push_backend = "auto"
    assert server_push_backend(engine.servers[0], engine.cfg, cuda=True) == "gloo"


def test_two_urls_of_one_server_are_refused_naming_both(rollout_servers, tmp_path):
    """One URL twice (refused before asking anything), and two names of one server: it reports the
    same id under both, so the trainer never pushes each version into it twice."""
    url = rollout_servers["servers"][0].url
    other_name = url.replace("127.0.0.1", "localhost")
    for twice in ([url + "/"], [other_name]):
        with pytest.raises(UserError, match="rollout.servers.urls") as info:
            fleet(rollout_servers, [0], tmp_path, urls=twice)
        message = str(info.value)
        assert f"{url} and {twice[0]}" in message or f"({url}) and 1 ({twice[0]})" in message, message


class HandshakeFails(BaseHTTPRequestHandler):
    """Answers /health and says who it is, then fails the weight push's handshake (HTTP 500)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("method") == "rltrain_server_id":
            self._send(200, {"results": ["handshake-fails"]})
        else:
            self._send(500, {"error": "engine died"})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def failing_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), HandshakeFails)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_that_fails_while_the_fleet_forms_is_down_and_the_others_go_on(rollout_servers, tmp_path, failing_server):
    engine = fleet(rollout_servers, [0], tmp_path, timeout_s=3.0, urls=[failing_server])
    assert engine.metrics()["rollout/servers_up"] == 1.0 and engine.metrics()["rollout/server_failures"] == 1.0
    assert "weight push" in engine.servers[1].reasons[-1]
    assert len(engine.generate(PROMPTS, SAMPLING)) == len(PROMPTS) * 2
    # Alone, it leaves no server: one paragraph (exit 2) within rollout.timeout_s, which is all the
    # fleet waits here (the failing server answers at once): long enough to ask it once more.
    started = time.monotonic()
    with pytest.raises(FleetDown, match="every rollout server stayed unreachable") as info:
        fleet(rollout_servers, [], tmp_path, timeout_s=1.5, urls=[failing_server])
    assert isinstance(info.value, UserError) and failing_server in str(info.value)
    assert time.monotonic() - started < 1.5 * 3 + 10
