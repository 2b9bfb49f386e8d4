"""The OpenAI-compatible endpoint agents call (env=agent): an HTTP server on 127.0.0.1 in the rank.

Each episode gets its own key, in its base URL (`http://127.0.0.1:PORT/episodes/KEY/v1`) and as its
API key, so every request is attributed to its episode. A request is checked here (what this
endpoint cannot serve is a 400 naming the parameter, never a hang), then queued; the thread that
owns the rollout engine takes the queue in batches (`take`) and answers each request (`Pending.answer`).
The server's threads only parse, queue and wait. A request of an episode past its deadline, or of
one that has ended, is refused with 410. docs/agents.md, "The endpoint".
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Parameters accepted and ignored: they change nothing this endpoint does (or only bookkeeping).
IGNORED = {"model", "user", "metadata", "store", "parallel_tool_calls", "seed", "service_tier", "stream_options", "prompt_cache_key"}
SUPPORTED = {"messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop"}
# Parameters accepted at their default value only.
DEFAULT_ONLY = {"stream": False, "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0, "top_logprobs": None,
                "response_format": {"type": "text"}, "logit_bias": None}
SERVED_MODEL = "policy"  # `model` may be any name: the run serves one policy


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status == 400 else "episode_error"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": None}}


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    use_tools: bool  # tool_choice is not "none"
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    n: int
    stop: list[str]


def parse_chat_request(body: Any) -> ChatRequest:
    """A chat completion request's parameters, or an ApiError(400) naming what cannot be served."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - SUPPORTED - IGNORED - set(DEFAULT_ONLY))
    if unknown:
        raise ApiError(400, f"this endpoint does not support the parameter(s) {unknown} (it serves: {sorted(SUPPORTED)})")
    for key, default in DEFAULT_ONLY.items():
        if key in body and body[key] not in (default, None):
            raise ApiError(400, f"{key}={body[key]!r} is not supported by this endpoint (only {default!r}): remove it")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ApiError(400, "messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and "function" in t for t in tools)):
        raise ApiError(400, "tools must be a list of {'type': 'function', 'function': {...}} objects")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise ApiError(400, f"tool_choice={choice!r} is not supported: the model decides (use 'auto' or 'none')")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, f"max_tokens={max_tokens!r} must be a positive integer")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float) or not 0 <= temperature <= 2):
        raise ApiError(400, f"temperature={temperature!r} must be a number between 0 and 2")
    top_p = body.get("top_p")
    if top_p is not None and (not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise ApiError(400, f"top_p={top_p!r} must be a number in (0, 1]")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not isinstance(n, int) or not 1 <= n <= 16:
        raise ApiError(400, f"n={n!r} must be an integer from 1 to 16")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"stop={body.get('stop')!r} must be a string or a list of non-empty strings")
    return ChatRequest(
        messages, tools or None, choice != "none", max_tokens, None if temperature is None else float(temperature),
        None if top_p is None else float(top_p), n, stop,
    )


@dataclass
class EpisodeSlot:
    """One episode's standing at the endpoint."""

    index: int
    deadline: float | None = None  # set when its worker starts it (env.timeout_s from then)
    closed: bool = False
    attempt: int = 0  # starts so far: a worker lost for another episode's sake plays it again from the start


@dataclass
class Pending:
    """A queued request; the server thread that received it waits for `answer`."""

    episode: int
    request: ChatRequest
    attempt: int = 0  # the episode's attempt that sent it (an earlier attempt's requests are refused)
    status: int = 0
    response: dict[str, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def answer(self, status: int, response: dict[str, Any]) -> None:
        self.status, self.response = status, response
        self.done.set()


class AgentEndpoint:
    """The server, the episodes of the current phase and the queue of their requests."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s  # an episode's bound, from its start
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.queue: list[Pending] = []
        self.slots: dict[str, EpisodeSlot] = {}
        self.by_index: list[EpisodeSlot] = []
        self.phase_deadline: float | None = None
        endpoint = self

        class Handler(_Handler):
            owner = endpoint

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="agent-endpoint", daemon=True)
        self.thread.start()

    def open_phase(self, count: int, deadline: float) -> list[str]:
        """Keys for `count` new episodes (the last phase's are closed); `deadline` bounds them all."""
        keys = [secrets.token_hex(12) for _ in range(count)]
        with self.lock:
            self.slots = {key: EpisodeSlot(i) for i, key in enumerate(keys)}
            self.by_index = list(self.slots.values())
            self.phase_deadline = deadline
        return keys

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{key}/v1"

    def close_phase(self) -> None:
        """End every episode: queued requests are refused, later ones too."""
        with self.lock:
            for slot in self.slots.values():
                slot.closed = True
            left, self.queue = self.queue, []
        for p in left:
            p.answer(410, ApiError(410, "the episode has ended").body())

    def take(self, wait_s: float, gather_s: float) -> list[Pending]:
        """The queued requests: waits up to `wait_s` for one, then `gather_s` for more (one batch)."""
        with self.arrived:
            if not self.queue:
                self.arrived.wait(wait_s)
            if not self.queue:
                return []
        time.sleep(gather_s)
        with self.lock:
            taken, self.queue = self.queue, []
        return taken

    def refusal(self, episode: int, attempt: int | None = None) -> ApiError | None:
        """Why a request of `episode` (sent by its `attempt`) cannot be served now (None: it can)."""
        with self.lock:
            return self._refusal(self.by_index[episode] if episode < len(self.by_index) else None, attempt)

    def attempt(self, episode: int) -> int:
        with self.lock:
            return self.by_index[episode].attempt

    def _refusal(self, slot: EpisodeSlot | None, attempt: int | None = None) -> ApiError | None:
        now = time.monotonic()
        if slot is None or slot.closed or (attempt is not None and attempt != slot.attempt):
            return ApiError(410, "the episode has ended")
        if slot.deadline is not None and now >= slot.deadline:
            return ApiError(410, f"the episode ran past env.timeout_s={self.timeout_s:g} s")
        if self.phase_deadline is not None and now >= self.phase_deadline:
            return ApiError(410, "the step's time for its episodes ran out")
        return None

    def start(self, key: str) -> None:
        with self.lock:
            slot = self.slots.get(key)
            if slot is None or slot.closed:
                raise ApiError(410, "the episode has ended")
            slot.attempt += 1
            if self.timeout_s:
                slot.deadline = time.monotonic() + self.timeout_s
            stale = [p for p in self.queue if p.episode == slot.index]
            self.queue = [p for p in self.queue if p.episode != slot.index]
        for p in stale:
            p.answer(410, ApiError(410, "the episode has ended").body())

    def submit(self, key: str, body: Any) -> Pending:
        """Check and queue one request of the episode `key`."""
        request = parse_chat_request(body)
        with self.lock:
            slot = self.slots.get(key)
            refusal = self._refusal(slot)
            if refusal is not None:
                raise refusal
            assert slot is not None
            pending = Pending(slot.index, request, slot.attempt)
            self.queue.append(pending)
            self.arrived.notify_all()
        return pending

    def close(self) -> None:
        self.close_phase()
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    # Hundreds of agents connect at once (env.max_concurrency), while the accepting thread shares
    # the GIL with every handler: socketserver's backlog of 5 drops their connections.
    request_queue_size = 4096

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet: a connection its agent's worker dropped (killed on a timeout) is that episode's failure."""


class _Handler(BaseHTTPRequestHandler):
    """POST /episodes/KEY/v1/chat/completions, GET /episodes/KEY/v1/models, POST /episodes/KEY/start;
    also /v1/... with the key as the bearer API key (clients that take only a key)."""

    owner: AgentEndpoint
    protocol_version = "HTTP/1.1"  # keep-alive, as OpenAI clients expect

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        """Quiet: a rank's log is for the run."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        key, route = self._route()
        if route == "/v1/models" and key is not None:
            self._send(200, {"object": "list", "data": [{"id": SERVED_MODEL, "object": "model", "created": 0, "owned_by": "rltrain"}]})
        else:
            self._send(404, ApiError(404, f"no such path: GET {self.path}").body())

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        key, route = self._route()
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            if key is None:
                raise ApiError(401, "no episode key: use the base URL and API key rltrain gave the agent")
            if route == "/start":
                self.owner.start(key)
                self._send(200, {"ok": True})
                return
            if route != "/v1/chat/completions":
                raise ApiError(404, f"no such path: POST {self.path} (this endpoint serves /v1/chat/completions)")
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                raise ApiError(400, "the request body is not JSON") from None
            pending = self.owner.submit(key, body)
        except ApiError as exc:
            self._send(exc.status, exc.body())
            return
        pending.done.wait()
        self._send(pending.status, pending.response)

    def _route(self) -> tuple[str | None, str]:
        """(the episode key, the path after it)."""
        path = self.path.split("?", 1)[0]
        if path.startswith("/episodes/"):
            rest = path[len("/episodes/") :]
            key, _, route = rest.partition("/")
            return key, "/" + route
        auth = self.headers.get("Authorization", "")
        return (auth[len("Bearer ") :].strip() or None) if auth.startswith("Bearer ") else None, path

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        with contextlib.suppress(OSError):  # the agent's worker was killed while it waited
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
