"""JSON over HTTP to one vLLM API server (rltrain/transport/http_json.py): every call bounded, and
every failure of the server itself (refused, reset, timed out, a 5xx) one `ServerDown` the fleet
counts and routes around. docs/rollout-servers.md.
"""

from __future__ import annotations

from typing import Any

from rltrain.transport.http_json import Failures, request_json

# A batch's prompts for one server in one request: our route in the server (rollout/server/batch_route.py).
BATCH_PATH = "/rltrain/generate"
# One weight version's load, cache resets and label in one request (rollout/server/load_route.py).
LOAD_PATH = "/rltrain/load"


class ServerDown(ConnectionError):
    """The server did not answer (refused, reset, timed out) or failed the request (HTTP 5xx)."""


class ServerRefused(ValueError):
    """The server answered 4xx (or not JSON): it runs, but cannot do what was asked (wrong flags, no dev mode)."""


SERVER_FAILURES = Failures(timeout=ServerDown, unavailable=ServerDown, refused=ServerRefused)


def call(url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """POST `body` (GET when None) to `url + path`; the decoded JSON answer (None when empty)."""
    return request_json(url.rstrip("/") + path, body, timeout_s, SERVER_FAILURES)


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
