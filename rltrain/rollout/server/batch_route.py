"""`POST /rltrain/generate`: a trainer's share of one batch for one server in one HTTP request.

The body is `{"requests": [...]}`, each entry the body of one vLLM `/inference/v1/generate`
request, all handled at once by vLLM's own token-in/token-out handler (each parsed, seeded and
scheduled as its own request; one prefill wave). Only the answer is ours, read straight from
vLLM's `RequestOutput`: per choice the token ids, the sampled log-probabilities, the finish reason,
the version spans and, with `"routing": true`, a MoE's routing record (rollout/server/routing_wire.py).
docs/rollout-servers.md, "Batched requests"; docs/moe.md, "Recording in a server".
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncGenerator, Sequence
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.logprobs import FlatLogprobs
from vllm.outputs import CompletionOutput, RequestOutput

from rltrain.rollout.server.client import BATCH_PATH as PATH
from rltrain.rollout.server.routing_wire import ROUTING_ARG, encode_routing, sample_key

router = APIRouter()
# vLLM's floor for a log-probability in its answers (-inf and NaN become this).
LOGPROB_FLOOR = -9999.0


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The log-probability of each sampled token, as vLLM's generate answer states it: clamped at
    `LOGPROB_FLOOR` (NaN too), the floor itself where the engine reported none for the token."""
    out = []
    for i, token in enumerate(token_ids):
        if isinstance(logprobs, FlatLogprobs):
            rows = range(logprobs.start_indices[i], logprobs.end_indices[i])
            value = next((logprobs.logprobs[j] for j in rows if logprobs.token_ids[j] == token), None)
        else:
            entry = (logprobs[i] or {}).get(token)
            value = None if entry is None else entry.logprob
        out.append(LOGPROB_FLOOR if value is None or math.isnan(value) else max(value, LOGPROB_FLOOR))
    return out


def compact_choice(output: CompletionOutput, with_logprobs: bool) -> dict[str, Any]:
    """One choice as the fleet reads it (rollout/server/batch_requests.py)."""
    spans = output.weight_versions
    return {
        "index": output.index, "token_ids": list(output.token_ids),
        "finish_reason": output.finish_reason or "stop",  # as vLLM's handler answers
        "logprobs": sampled_logprobs(output.token_ids, output.logprobs) if with_logprobs else [],
        "weight_versions": None if spans is None else [{"version": s.version, "start": s.start, "end": s.end} for s in spans],
    }


class CompactServingTokens(ServingTokens):
    """vLLM's token-in/token-out handler, sharing the server's (`compact_handler`), whose answer to
    a non-streamed request is the compact dict instead of vLLM's response objects."""

    async def serve_tokens_full_generator(
        self, request: GenerateRequest, result_generator: AsyncGenerator[RequestOutput, None], request_id: str,
        model_name: str, request_metadata: Any,
    ) -> ErrorResponse | dict[str, Any]:
        final = None
        try:
            async for result in result_generator:
                final = result
        except asyncio.CancelledError:
            return self.create_error_response("Client disconnected")
        assert final is not None
        choices = []
        for output in final.outputs:
            self._raise_if_error(output.finish_reason, request_id)
            choices.append(compact_choice(output, request.sampling_params.logprobs is not None))
        return {"choices": choices, "prompt_token_ids": final.prompt_token_ids if request.return_token_ids else None}


def compact_handler(app: FastAPI) -> CompactServingTokens:
    """The server's own handler (`app.state.serving_tokens`, built when the server starts) as a
    `CompactServingTokens`: the same state, so the same model, renderer and engine client."""
    try:
        return app.state.rltrain_serving_tokens
    except AttributeError:
        handler = CompactServingTokens.__new__(CompactServingTokens)
        handler.__dict__.update(app.state.serving_tokens.__dict__)
        app.state.rltrain_serving_tokens = handler
        return handler


@router.post(PATH)
async def generate_batch(raw_request: Request) -> Response:
    handler = compact_handler(raw_request.app)
    try:
        body = msgspec.json.decode(await raw_request.body())
        requests = [GenerateRequest.model_validate(entry) for entry in body["requests"]]
    except (ValueError, KeyError, TypeError) as exc:  # msgspec.DecodeError and pydantic's ValidationError are ValueErrors
        return JSONResponse({"error": f"{PATH}: {exc!r}"}, status_code=HTTPStatus.BAD_REQUEST)
    for request in requests:  # each entry's own parameters: neither changes a sample
        request.sampling_params.flat_logprobs = True  # logprobs in flat lists, read by sampled_logprobs
        request.sampling_params.skip_clone = True  # no deep copy in the engine: this object serves one request
    route_keys = mark_for_routing(requests) if bool(body.get("routing")) else None
    try:
        answers = await asyncio.gather(*(handler.serve_tokens(request, raw_request) for request in requests))
    finally:  # taken even when a request failed: the tap keeps nothing past its request
        records = None if route_keys is None else await take_routing(handler, requests, route_keys)
    for answer in answers:
        if not isinstance(answer, dict):  # an ErrorResponse (or a stream, asked of a batch): the first one decides
            if isinstance(answer, ErrorResponse):
                return JSONResponse(answer.model_dump(), status_code=answer.error.code)
            return JSONResponse({"error": f"{PATH}: streamed requests are not batched"}, status_code=HTTPStatus.BAD_REQUEST)
    if route_keys is not None:
        for request, key, answer in zip(requests, route_keys, answers, strict=True):
            attach_routing(answer, records, key, request.sampling_params.seed)
    return Response(msgspec.json.encode({"answers": answers}), media_type="application/json")



def mark_for_routing(requests: list[GenerateRequest]) -> list[str]:
    """Mark each request for the worker's routing tap with a key of its own (concurrent requests of
    other trainer ranks may carry the same seeds): the keys, in order."""
    keys = []
    for request in requests:
        key = uuid.uuid4().hex
        request.sampling_params.extra_args = {**(request.sampling_params.extra_args or {}), ROUTING_ARG: key}
        keys.append(key)
    return keys


async def take_routing(handler: CompactServingTokens, requests: list[GenerateRequest], keys: list[str]) -> dict[str, Any] | None:
    """Every sample's record of these requests from the worker's tap (by sample_key: the route's
    key and the sample's seed, vLLM seeding the `n` samples seed, seed+1, ...); None where the server
    records none (a dense model, a GPU)."""
    wanted = [
        sample_key(key, request.sampling_params.seed + c)
        for key, request in zip(keys, requests, strict=True) if request.sampling_params.seed is not None
        for c in range(request.sampling_params.n)
    ]
    answer = (await handler.engine_client.collective_rpc("rltrain_take_routing", args=(json.dumps(wanted),)))[0]
    return None if answer is None else json.loads(answer)


def attach_routing(answer: dict[str, Any], records: dict[str, Any] | None, key: str, seed: int | None) -> None:
    """Each choice's record (`"routing"`, routing_wire.encode_routing), cut to its tokens (a forward
    may run past a stop); null where none was kept."""
    import torch

    from rltrain.models.moe import ROUTING_DTYPE
    from rltrain.rollout.vllm_routing import completion_routing

    for choice in answer["choices"]:
        found = None if records is None or seed is None else records.get(sample_key(key, seed + choice["index"]))
        if found is None:
            choice["routing"] = None
            continue
        by_seed = {0: torch.tensor(found, dtype=ROUTING_DTYPE)}
        record = completion_routing(by_seed, 0, len(choice["token_ids"]))
        choice["routing"] = None if record is None else encode_routing(record)
