"""A batch as requests to the fleet's servers: its prompts in contiguous runs, one request to one
server each (`batch_chunks`), each prompt's part of the request (`prompt_body`: its `n` samples,
seeded by its index in the batch) and the completions read back from its answer
(`answer_completions`, each checked to carry the engine's weight version, and with its routing
record where the server returns one: rollout/server/routing_wire.py). The fleet (fleet.py)
routes the requests; docs/rollout-servers.md.
"""

from __future__ import annotations

from typing import Any

from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.images import PromptImages
from rltrain.rollout.seeds import request_seed
from rltrain.rollout.server.images import generate_fields
from rltrain.rollout.server.routing_wire import decode_routing
from rltrain.runtime.errors import UserError


def batch_chunks(n_prompts: int, n_servers: int) -> list[range]:
    """A batch's prompts as contiguous runs, one request each: as many as servers are up (at least
    one), so each server gets one request per batch and a failed server costs only its run."""
    parts = max(1, min(n_prompts, n_servers))
    bounds = [n_prompts * k // parts for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def prompt_body(
    index: int, prompt: list[int], sampling: SamplingSettings, images: PromptImages | None, image_token: int | None,
    cache_salt: str | None,
) -> dict[str, Any]:
    """One prompt's `/inference/v1/generate` body: its `n` samples, seeded by its index in the batch;
    `cache_salt` keeps prefix caches apart across versions while requests are held (stream.py)."""
    body = {
        **generate_fields(index, prompt, images, image_token),  # images: rollout/server/images.py
        "sampling_params": {
            "n": sampling.n, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens, "seed": request_seed(sampling.seed, index, sampling.n),
            "stop_token_ids": sorted(set(sampling.stop_token_ids)) or None,
            "logprobs": 0, "detokenize": False,
        },
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def answer_completions(
    index: int, answer: dict[str, Any], url: str, version: int, prompt_ids: list[int] | None = None,
    routing_required: bool = False,
) -> list[Completion]:
    """The completions of prompt `index` in a server's answer; one sampled by another weight version
    than the engine's `version` stops the run, and so does one without a routing record where
    router replay needs it (`routing_required`)."""
    out = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        versions = {span["version"] for span in choice.get("weight_versions") or []}
        if versions != {str(version)}:
            raise UserError(
                f"rollout=server: {url} sampled a completion with weight version {sorted(versions)} where the "
                f"schedule names version {version}: another trainer pushes weights into it, or it restarted "
                "without them. Give each run its own servers (rollout.servers.urls)."
            )
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(lp) for lp in choice["logprobs"]]
        wire = choice.get("routing")
        if wire is None and routing_required:
            raise UserError(no_record_message(url))
        out.append(Completion(
            index, token_ids, logprobs, finished=choice["finish_reason"] == "stop", prompt_ids=prompt_ids,
            version=int(versions.pop()), routing=None if wire is None else decode_routing(wire),
        ))
    return out


def no_record_message(url: str) -> str:
    return (
        f"algo.router_replay=true with rollout=server: {url} returned no routing record for a completion, so there "
        "is nothing to replay. rltrain records a MoE's routing in its own API server on vLLM's CPU build (spawned "
        "with rollout.servers.spawn, or started with `python -m rltrain.serve`); a server on a GPU, or one started "
        "otherwise (a plain `vllm serve`), records none. Point rollout.servers.urls at such CPU servers, or set "
        "algo.router_replay=false (rollout/mismatch_kl still measures the mismatch). docs/moe.md."
    )
