"""Router replay's record on its way out of an API server (`rollout=server`): the key rltrain's
batch route gives each of its requests, and one completion's record in the route's answer.

Several trainer ranks' requests run at once on one server and their seeds may collide, so the tap
in the server's worker (rltrain/rollout/vllm_routing.py) keeps a request's rows under the key the
route put in its `SamplingParams.extra_args` plus its seed (vLLM seeds the `n` samples of a request
seed, seed+1, ...). A record travels as its shape and the base64 of its int16 bytes: layers x k x
2 bytes per token, a third more in base64. docs/moe.md, "Recording in a server".
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from rltrain.models.moe import ROUTING_DTYPE, is_moe

# The `extra_args` entry that asks the server's tap to record a request (its value: the route's key).
ROUTING_ARG = "rltrain_routing"


def model_is_moe(model_dir: Path) -> bool:
    """Whether the model directory's config.json (or its text model's) names experts, read without
    building a config (the fleet's trainer side never builds the model)."""
    config = json.loads((model_dir / "config.json").read_text())
    return any(is_moe(SimpleNamespace(**part)) for part in (config, config.get("text_config") or {}))


def server_key(params: Any) -> str | None:
    """The key a request's record is kept under in a server's tap: the route's key and the sample's
    seed; None (not recorded) for a request the route did not mark, or one without a seed."""
    route_key = (params.extra_args or {}).get(ROUTING_ARG)
    if route_key is None or params.seed is None:
        return None
    return sample_key(route_key, params.seed)


def sample_key(route_key: str, seed: int) -> str:
    return f"{route_key}:{int(seed)}"


def encode_routing(experts_TLK: torch.Tensor) -> dict[str, Any]:
    """[tokens, layers, k] int16 as JSON: {"shape": [...], "b64": little-endian int16 bytes}."""
    array: np.ndarray = experts_TLK.to(ROUTING_DTYPE).numpy().astype("<i2", copy=False)
    return {"shape": list(array.shape), "b64": base64.b64encode(array.tobytes()).decode("ascii")}


def decode_routing(wire: dict[str, Any]) -> torch.Tensor:
    """`encode_routing`'s inverse; a record whose bytes do not fill its shape raises ValueError."""
    shape = [int(d) for d in wire["shape"]]
    raw = base64.b64decode(wire["b64"], validate=True)
    if len(shape) != 3 or len(raw) != 2 * int(np.prod(shape)):
        raise ValueError(f"a routing record of {len(raw)} bytes does not fill the shape {shape} (int16)")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int16).reshape(shape)).to(ROUTING_DTYPE)
