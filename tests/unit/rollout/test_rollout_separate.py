"""The out-of-process vLLM engine (`rollout.process=separate`): parity, control, death, cleanup.

One child engine serves the test (building one costs ~10 s on CPU). After a weight update its
log-probabilities must be those of the new weights (the e2e test shows that it gives the very
rows of the in-process engine); it must refuse to generate while asleep and stay usable after
that error reply; and, when killed in the middle of a weight sync, fail with a clear error well
within the timeout, leaving no endpoint directory and nothing in /dev/shm."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import time

import pytest
import torch

from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.control_wire import ControlChannel, completions_from_json, completions_to_json
from rltrain.transport.wire import ProtocolError

# Counts rlsep-* directories and /dev/shm segments, which any separate-engine run creates: no such run
# may overlap it on another pytest-xdist worker (docs/testing.md, "Start-up").
pytestmark = pytest.mark.xdist_group("separate_engine")

SAMPLING = SamplingSettings(n=2, temperature=1.0, max_new_tokens=5, seed=7)
PROMPTS = [[1, 2, 3, 4], [5, 6]]


def test_completions_cross_as_json_exactly():
    completions = [
        Completion(0, [3, 4], [-0.1234567890123, -2.5e-8], True), Completion(1, [], [], False),
        Completion(2, [5, 9], [-0.5, 0.0], False, [True, False], [7, 8], 3),  # an agent's sequence, sampled by version 3
    ]
    wire = json.loads(json.dumps(completions_to_json(completions)))
    assert completions_from_json(wire) == completions


def test_a_completions_recorded_routing_survives_the_wire():
    """A MoE's routing ([tokens, layers, k], docs/moe.md "Router replay") as a batch in flight's
    checkpoint writes it."""
    from rltrain.models.moe import ROUTING_DTYPE

    routing = torch.tensor([[[3, 0], [1, 2]], [[7, 5], [4, 6]]], dtype=ROUTING_DTYPE)
    wire = json.loads(json.dumps(completions_to_json([Completion(0, [3, 4], [-0.5, -1.0], True, routing=routing)])))
    (back,) = completions_from_json(wire)
    assert back.routing is not None and back.routing.dtype == ROUTING_DTYPE and torch.equal(back.routing, routing)


def test_control_channel_rejects_pickle_and_unknown_messages():
    import pickle

    for payload, error in (
        (pickle.dumps({"op": "ping", "id": 1}), "pickle"),
        ({"op": "rm -rf", "id": 1}, "malformed"),
        ({"op": "ping", "id": "1"}, "malformed"),
    ):
        a, b = socket.socketpair()
        try:
            if isinstance(payload, bytes):
                a.sendall(payload)
            else:
                ControlChannel(a, "test", 2).send(payload)
            with pytest.raises(ProtocolError, match=error):
                ControlChannel(b, "test peer", timeout_s=2).recv("a request")
        finally:
            a.close()
            b.close()


@pytest.fixture(autouse=True)
def warm_rollout_process(monkeypatch):
    """The rollout process an engine starts here is a stand-in, forked warm by the rank server, as
    under a warm run (tests/stand_in.py); the product's side is unchanged (docs/testing.md)."""
    from cli import torchrun_ranks_env

    for key, value in torchrun_ranks_env().items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def model_dir(tiny_cache):
    from rltrain.config.schema import ModelConfig
    from rltrain.models.tiny import build_tiny_model_dir

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return build_tiny_model_dir(cfg, seed=3)


def _halved(model_dir) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model, [(k, v.clone()) for k, v in model.state_dict().items() if k != "lm_head.weight"]


@torch.no_grad()
def _max_logprob_diff(model: torch.nn.Module, completions: list[Completion]) -> float:
    """Largest |engine log-prob - transformers log-prob| over every sampled token."""
    worst = 0.0
    for c in completions:
        ids = torch.tensor([PROMPTS[c.prompt_index] + c.token_ids])
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(PROMPTS[c.prompt_index])
        ours = logp[start - 1 : -1].gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        worst = max(worst, float((ours - torch.tensor(c.logprobs)).abs().max()))
    return worst


def test_separate_engine_end_to_end(model_dir):
    from rltrain.config.group_options import VLLMRolloutConfig
    from rltrain.rollout.separate import RolloutProcessError, SeparateVLLMEngine

    cfg = VLLMRolloutConfig(kv_cache_gib=1, timeout_s=20, bucket_mb=1)
    engine = SeparateVLLMEngine(model_dir, cfg, seed=0, num_threads=1)
    directory = engine.directory
    try:
        assert engine.ping()
        before = engine.generate(PROMPTS, SAMPLING)
        assert [c.prompt_index for c in before] == [0, 0, 1, 1]
        model, halved = _halved(model_dir)
        engine.update_weights(halved)  # 1 MiB buckets: several buckets per sync
        after = engine.generate(PROMPTS, SAMPLING)
        assert after != before
        assert _max_logprob_diff(model, after) < 1e-4  # the child's weights are the new ones

        engine.sleep()
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(PROMPTS, SAMPLING)
        engine.wake()  # an error reply leaves the engine usable
        assert engine.generate(PROMPTS, SAMPLING) == after
        assert [name[:4] for name in os.listdir(directory)] == ["rlc-"]  # no per-sync endpoint is left

        # A wedged child (stopped): the ping fails within its bound, names the process and leaves
        # it running; once it resumes, its late ping reply is skipped and the engine works as before.
        engine.ping_timeout_s = 1.0
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RolloutProcessError, match=f"pid {engine.pid}.* did not answer a ping within 1 s"):
                engine.ping()
            assert time.monotonic() - started < 5
            assert engine.proc.poll() is None and engine.channel is not None
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        assert engine.generate(PROMPTS, SAMPLING) == after
        assert engine.ping() is True

        # Killed in the middle of a weight sync: the sender fails fast, not at its timeout.
        def dying(weights):
            for i, item in enumerate(weights):
                if i == 3:
                    os.kill(engine.pid, signal.SIGKILL)
                yield item

        started = time.monotonic()
        with pytest.raises(RolloutProcessError, match="exit code -9"):
            engine.update_weights(dying(halved))
        assert time.monotonic() - started < cfg.timeout_s
        with pytest.raises(RolloutProcessError, match="closed"):
            engine.generate(PROMPTS, SAMPLING)
        with pytest.raises(RolloutProcessError, match="closed"):
            engine.ping()
    finally:
        engine.close()
    assert not os.path.exists(directory)
    assert glob.glob("/dev/shm/rltrain-w-*") == []


def test_a_batch_asked_for_ahead_does_not_block_a_weight_push(model_dir):
    """In flight the trainer asks for the next batch before it trains (`post`), so the batch's
    answer can be complete, and larger than the socket's buffer, while the trainer pushes the next
    version: the child's loop must still receive the weights (its answers have their own writer),
    and the answer must arrive whole afterwards, sampled before the push."""
    import select

    from rltrain.config.group_options import VLLMRolloutConfig
    from rltrain.rollout.separate import SeparateVLLMEngine

    per_step, group, budget = 48, 8, 100
    cfg = VLLMRolloutConfig(kv_cache_gib=1, timeout_s=20, bucket_mb=1)
    engine = SeparateVLLMEngine(model_dir, cfg, seed=0, num_threads=1)
    try:
        options = {
            "stream": True, "deterministic": False, "max_staleness": 1, "per_step": per_step, "group_size": group,
            "lag_steps": 8, "version": 0, "first_step": 1, "expected_groups": per_step, "eval_versions": [],
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": budget, "stop_token_ids": []},
        }
        engine.request("stream_open", options=options)
        groups = [{"index": i, "step": 1, "position": i, "prompt_ids": [3 + i, 4, 5], "seed": 11} for i in range(per_step)]
        posted = engine.post("take", step=1, groups=groups)
        assert select.select([engine.channel.sock], [], [], 60)[0], "the batch was not answered within 60 s"
        _, halved = _halved(model_dir)
        engine.update_weights(halved)  # the answer (more than the socket holds, below) is still unread
        taken = engine.reply(posted)
        sock = engine.channel.sock
        held = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert len(taken["groups"]) == per_step and len(json.dumps(taken)) > held  # the case this test is for
        assert {v for g in taken["groups"] for vs in g["versions"] for v in vs} == {0}
        assert engine.request("ping") is True  # the channel is in step after the early answer
    finally:
        engine.close()
