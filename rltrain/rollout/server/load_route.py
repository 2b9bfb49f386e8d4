"""`POST /rltrain/load`: the API server's end of one weight push, in one HTTP request.

The body is `{"manifest": ..., "version": ..., "timeout": ...}`. The route runs the worker
extension's `rltrain_receive` with the manifest (the buckets then arrive over the pair group,
rollout/server/extension.py), then resets the prefix and encoder caches (entries computed by the
old weights) and labels the server's weights with `version`, which every completion then reports:
one trip through the API server per push rather than one per step (each costs its CPU, which the
engine shares on a small machine). The answer: the workers' results, and whether the prefix cache
was reset (not while requests are held in flight, docs/async.md). docs/rollout-servers.md,
"Weights pushed, versions proven".
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rltrain.rollout.server.client import LOAD_PATH

router = APIRouter()


@router.post(LOAD_PATH)
async def load_version(raw_request: Request) -> JSONResponse:
    try:
        body = await raw_request.json()
        manifest, version, timeout_s = str(body["manifest"]), str(body["version"]), float(body["timeout"])
    except (ValueError, KeyError, TypeError) as exc:
        return JSONResponse({"error": f"{LOAD_PATH}: {exc!r}"}, status_code=HTTPStatus.BAD_REQUEST)
    engine = raw_request.app.state.engine_client
    results = await engine.collective_rpc("rltrain_receive", timeout=timeout_s, args=(manifest,))
    # Loaded: the rest at once (the engine core takes them in turn; no request is scheduled between:
    # the trainer sends none during a push, and requests held in flight stay held until /resume).
    reset, _, _ = await asyncio.gather(
        engine.reset_prefix_cache(),
        engine.reset_encoder_cache(),  # image embeddings of the old weights
        engine.update_weight_version(version),
    )
    return JSONResponse({"results": results, "prefix_cache_reset": bool(reset)})
