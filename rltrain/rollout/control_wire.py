"""What crosses the separate engine's control channel (rltrain/rollout/separate.py and its child):
framed JSON control messages, and completions as plain JSON data (also how generating ahead writes
a batch in flight into a checkpoint). JSON only, never pickle: docs/internals/rollout.md.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import torch

from rltrain.models.moe import ROUTING_DTYPE
from rltrain.rollout.base import Completion
from rltrain.rollout.images import from_data_url, to_data_url
from rltrain.transport.wire import Channel, Message, ProtocolError

OPS = frozenset({"ready", "reply", "generate", "update", "sleep", "wake", "ping", "close", "stream_open", "submit", "take"})


class ControlChannel(Channel):
    """The request/reply channel to the rollout process: the transport's framing and JSON-only
    rule, with control messages `{"op": ..., "id": int, ...}` instead of sync messages."""

    def recv(self, what: str) -> Message:
        body = self.recv_body(what)
        try:
            message = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"control message from the {self.peer} is not JSON") from exc
        if (
            not isinstance(message, dict)
            or message.get("op") not in OPS
            or type(message.get("id")) is not int
        ):
            raise ProtocolError(f"malformed control message from the {self.peer}: {str(message)[:200]}")
        return message


def completions_to_json(completions: list[Completion]) -> list[dict[str, Any]]:
    """Completions as plain data (an episode's own images as PNG data URLs)."""
    return [
        {**{f.name: getattr(c, f.name) for f in fields(c) if f.name not in ("images", "routing")},
         "images": [to_data_url(im) for im in c.images] if c.images is not None else None,
         "routing": c.routing.tolist() if c.routing is not None else None}
        for c in completions
    ]


def completions_from_json(rows: list[dict[str, Any]]) -> list[Completion]:
    return [
        Completion(
            int(r["prompt_index"]),
            [int(t) for t in r["token_ids"]],
            [float(x) for x in r["logprobs"]],
            bool(r["finished"]),
            [bool(x) for x in r["sampled"]] if r.get("sampled") is not None else None,
            [int(t) for t in r["prompt_ids"]] if r.get("prompt_ids") is not None else None,
            int(r["version"]) if r.get("version") is not None else None,
            [from_data_url(url) for url in r["images"]] if r.get("images") is not None else None,
            routing_from_json(r.get("routing")),
        )
        for r in rows
    ]


def routing_from_json(rows: list | None) -> torch.Tensor | None:
    """A completion's recorded routing from its nested lists (an empty completion keeps no shape:
    [0, 0, 0])."""
    if rows is None:
        return None
    return torch.tensor(rows, dtype=ROUTING_DTYPE) if rows else torch.zeros((0, 0, 0), dtype=ROUTING_DTYPE)
