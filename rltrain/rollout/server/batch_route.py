"""`POST /rltrain/generate`: a trainer's share of one batch for one server in one HTTP request.

The body is `{"requests": [...]}`, each entry the body of one vLLM `/inference/v1/generate`
request (token ids, its own sampling parameters and seed, images as content parts). The route
hands every entry to vLLM's own token-in/token-out handler at once, so each prompt is sampled
exactly as its own request would be (the same defaults, seed and checks), and they all reach the
engine's scheduler together, one prefill wave as in the in-process engine. The answer keeps what
the trainer reads per choice (token ids, raw log-probabilities as plain floats, finish reason,
weight-version spans) and the expanded prompt where asked: one request and one JSON document
per server and batch instead of one per prompt. docs/rollout-servers.md, "Batched requests".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from rltrain.rollout.server.client import BATCH_PATH as PATH

router = APIRouter()


def compact(answer: Any) -> dict[str, Any]:
    """One `/inference/v1/generate` answer (vLLM's response object), reduced to what the fleet
    reads (rollout/server/batch_requests.py): no per-token log-probability objects, no usage."""
    choices = []
    for choice in answer.choices:
        content = choice.logprobs.content if choice.logprobs is not None else []
        choices.append({
            "index": choice.index, "token_ids": choice.token_ids, "finish_reason": choice.finish_reason,
            "logprobs": [entry.logprob for entry in content], "weight_versions": jsonable_encoder(choice.weight_versions),
        })
    return {"choices": choices, "prompt_token_ids": answer.prompt_token_ids}


@router.post(PATH)
async def generate_batch(raw_request: Request) -> JSONResponse:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateResponseBase

    handler = raw_request.app.state.serving_tokens
    bodies = (await raw_request.json())["requests"]
    try:
        requests = [GenerateRequest.model_validate(body) for body in bodies]
    except ValueError as exc:
        return JSONResponse({"error": f"{PATH}: {exc}"}, status_code=HTTPStatus.BAD_REQUEST)
    answers = await asyncio.gather(*(handler.serve_tokens(request, raw_request) for request in requests))
    out = []
    for answer in answers:
        if not isinstance(answer, GenerateResponseBase):  # an ErrorResponse: the first one decides
            return JSONResponse(answer.model_dump(), status_code=answer.error.code)
        out.append(compact(answer))
    return JSONResponse({"answers": out})


def with_batch_route(build_app: Callable[..., FastAPI]) -> Callable[..., FastAPI]:
    """vLLM's `build_app` with this route added (rltrain/rollout/server/api_server.py)."""

    def build(*args: Any, **kwargs: Any) -> FastAPI:
        app = build_app(*args, **kwargs)
        app.include_router(router)
        return app

    return build
