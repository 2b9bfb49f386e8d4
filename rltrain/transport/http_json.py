"""One JSON request over HTTP with the standard library only, bounded by a timeout: the rollout
fleet's calls to its vLLM servers (rltrain/rollout/server/client.py) and the LLM judge's to its
endpoint (rltrain/rewards/judge/endpoint.py). A failure is one of three kinds, raised as the
caller's own exception types (`Failures`) because each caller counts and retries them its own way:
no answer in time, no answer or an HTTP 5xx (another try may work), and an HTTP 4xx or an answer
that is not JSON (another try would fail the same way).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Failures:
    """The exception types a caller wants for each kind of failure."""

    timeout: type[Exception]  # no answer within the timeout
    unavailable: type[Exception]  # refused, reset, or an HTTP 5xx
    refused: type[Exception]  # an HTTP 4xx, or an answer that is not JSON


def request_json(
    url: str, body: dict[str, Any] | None, timeout_s: float, failures: Failures, *,
    api_key: str | None = None, detail_chars: int = 2000,
) -> Any:
    """POST `body` as JSON (GET when None) to `url`; the decoded answer (None when empty).
    `api_key`: sent as a bearer token; `detail_chars`: how much of an error page a message keeps."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:detail_chars].decode(errors="replace")
        if exc.code >= 500:
            raise failures.unavailable(f"{url} failed with HTTP {exc.code}: {detail}") from exc
        raise failures.refused(f"{url} refused the request with HTTP {exc.code}: {detail}") from exc
    except TimeoutError as exc:
        raise failures.timeout(f"{url} did not answer within {timeout_s:g} s") from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (TimeoutError, socket.timeout)):
            raise failures.timeout(f"{url} did not answer within {timeout_s:g} s") from exc
        raise failures.unavailable(f"{url} did not answer: {exc.reason}") from exc
    except (http.client.HTTPException, OSError) as exc:
        raise failures.unavailable(f"{url} did not answer: {exc}") from exc
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise failures.refused(f"{url} answered something other than JSON: {raw[:200]!r}") from exc
