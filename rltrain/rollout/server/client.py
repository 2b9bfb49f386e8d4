"""JSON over HTTP to one vLLM API server, with the standard library only: every call bounded, and
every failure of the server itself (refused, reset, timed out, a 5xx) one `ServerDown` the fleet
counts and routes around. docs/rollout-servers.md.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

# A batch's prompts for one server in one request: our route in the server (rollout/server/batch_route.py).
BATCH_PATH = "/rltrain/generate"
# One weight version's load, cache resets and label in one request (rollout/server/load_route.py).
LOAD_PATH = "/rltrain/load"


class ServerDown(ConnectionError):
    """The server did not answer (refused, reset, timed out) or failed the request (HTTP 5xx)."""


class ServerRefused(ValueError):
    """The server answered 4xx: it runs, but cannot do what was asked (wrong flags, no dev mode)."""


def call(url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """POST `body` (GET when None) to `url + path`; the decoded JSON answer (None when empty)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:2000].decode(errors="replace")
        if exc.code >= 500:
            raise ServerDown(f"{url}{path} failed with HTTP {exc.code}: {detail}") from exc
        raise ServerRefused(f"{url}{path} refused the request with HTTP {exc.code}: {detail}") from exc
    except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise ServerDown(f"{url}{path} did not answer: {exc}") from exc
    return json.loads(raw) if raw else None


def collective_rpc(url: str, method: str, args: list[str], timeout_s: float) -> list[Any]:
    """One method of the worker extension on every worker of the server (vLLM's dev-mode
    `/collective_rpc`: string arguments only); the workers' answers."""
    answer = call(url, "/collective_rpc", {"method": method, "args": args, "timeout": timeout_s}, timeout_s + 5)
    return list(answer["results"]) if answer else []


def server_identity(url: str, timeout_s: float) -> str:
    """Which server answers at `url`: the id its worker extension reports (rltrain_server_id), the
    same under every name that reaches it."""
    return str(collective_rpc(url, "rltrain_server_id", [], timeout_s)[0])


def is_up(url: str, timeout_s: float = 2.0) -> bool:
    try:
        call(url, "/health", None, timeout_s)
    except (ServerDown, ServerRefused):
        return False
    return True
