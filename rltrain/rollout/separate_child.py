"""The rollout process of `rollout.process=separate`: one `VLLMRolloutEngine` serving requests.

Started by `rltrain.rollout.separate.SeparateVLLMEngine` as
`python -m rltrain.rollout.separate_child '<json spec>'`, with the control socket inherited as a
file descriptor. It answers one request at a time, in order, each reply tagged with the request's
id; any exception becomes an error reply (the engine stays up, the parent decides). It exits when
asked to, or as soon as the parent's end of the control socket closes (the parent died), so a
crashed trainer never leaves an engine behind.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rltrain.rollout.control_wire import ControlChannel

IDLE_POLL_S = 1.0  # how often an idle child re-checks that its parent is alive


def _serve(channel: ControlChannel, engine: Any, receiver: Any) -> None:
    from rltrain.rollout.base import SamplingSettings
    from rltrain.rollout.control_wire import completions_to_json
    from rltrain.rollout.images import images_from_json
    from rltrain.transport.wire import PeerClosed

    parent = os.getppid()
    while True:
        readable, _, _ = select.select([channel.sock], [], [], IDLE_POLL_S)
        if not readable:
            if os.getppid() != parent:  # re-parented: the trainer is gone
                return
            continue
        try:
            request = channel.recv("a request")
        except PeerClosed:
            return
        op, request_id = request["op"], request["id"]
        reply: dict[str, Any] = {"op": "reply", "id": request_id, "ok": True}
        try:
            if op == "generate":
                images = images_from_json(request.get("images"))
                completions = engine.generate(request["prompts"], SamplingSettings(**request["sampling"]), images=images)
                reply["result"] = completions_to_json(completions)
            elif op == "update":
                engine.update_weights(receiver.receive(copy=True))
            elif op == "sleep":
                engine.sleep()
            elif op == "wake":
                engine.wake()
            elif op == "ping":
                reply["result"] = engine.ping()
            elif op == "close":
                channel.send(reply)
                return
            elif op == "stream_open":  # placement.weight_update=in_flight: the step loop from here on
                from rltrain.rollout.inflight_child import serve_stream

                serve_stream(channel, engine, receiver, request)
                return
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception:  # noqa: BLE001 - reported to the parent, which raises it
            reply = {"op": "reply", "id": request_id, "ok": False, "error": traceback.format_exc()[-8000:]}
        channel.send(reply)


def main(argv: list[str]) -> int:
    return run(argv[0])


def run(spec_json: str) -> int:
    """Build the engine `spec_json` describes, report ready and serve; the process's exit status."""
    from rltrain.rollout.control_wire import ControlChannel

    spec = json.loads(spec_json)
    sock = socket.socket(fileno=spec["control_fd"])
    channel = ControlChannel(sock, "trainer", spec["cfg"]["timeout_s"])
    engine = receiver = None
    try:
        import torch

        from rltrain.config.group_options import VLLMRolloutConfig
        from rltrain.rollout.vllm import VLLMRolloutEngine
        from rltrain.transport.receiver import WeightReceiver

        torch.set_num_threads(int(spec["num_threads"]))
        engine = VLLMRolloutEngine(
            spec["model_dir"], VLLMRolloutConfig(**spec["cfg"]), seed=spec["seed"], dtype=spec["dtype"]
        )
        receiver = WeightReceiver(spec["weights_control_path"], timeout_s=spec["cfg"]["timeout_s"])
        ready = {"op": "ready", "id": 0, "ok": True, "pid": os.getpid()}
        channel.send({**ready, "weights_survive_sleep": engine.weights_survive_sleep})
    except Exception:  # noqa: BLE001 - the parent raises it
        channel.send({"op": "ready", "id": 0, "ok": False, "error": traceback.format_exc()[-8000:]})
        return 1
    try:
        _serve(channel, engine, receiver)
    finally:
        receiver.close()
        engine.close()
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
