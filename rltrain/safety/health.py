"""HTTP health endpoints on rank 0 (`health.port=N`), for a load balancer or a cluster's probes.

`/healthz` is liveness; `/healthz/deep` also needs every rank's recent progress and a rollout
engine that answers a ping. Served by stdlib `http.server` in a daemon thread, so it keeps
answering while the main thread is stuck in a collective, with every ping and request bounded so
the check fails instead of hanging. Details: docs/internals/safety.md.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rltrain.safety.heartbeat import rank_status


def ping_with_timeout(
    ping: Callable[[], object], timeout_s: float, started: list[threading.Thread] | None = None
) -> tuple[bool, str]:
    """(answered, detail). A ping that returns False, raises or takes longer than `timeout_s` fails.
    The ping's thread is appended to `started` (to tell whether it still runs)."""
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = ping()
        except Exception as exc:  # noqa: BLE001 - any failure means "not healthy"
            result["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=call, name="rltrain-health-ping", daemon=True)
    thread.start()
    if started is not None:
        started.append(thread)
    thread.join(timeout_s)
    if thread.is_alive():
        return False, f"no answer to ping within {timeout_s:g} s"
    if "error" in result:
        return False, f"ping failed: {result['error']}"
    if result.get("value") is False:
        return False, "ping returned False"
    return True, "ok"


_BUSY_BODY = json.dumps({"status": "busy", "dead": ["too many concurrent health requests"]}).encode()
BUSY_REPLY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\nConnection: close\r\n\r\n".encode()
    + _BUSY_BODY
)


class _BoundedServer(ThreadingHTTPServer):
    """At most `max_connections` handler threads; one more connection is answered 503 and closed
    without a thread (a non-blocking send of a few bytes into an empty socket buffer)."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(BUSY_REPLY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HealthServer:
    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        stale_after_s: float,
        port: int = 0,
        host: str = "127.0.0.1",
        ping: Callable[[], object] | None = None,
        ping_timeout_s: float = 5.0,
        request_timeout_s: float = 10.0,
        max_connections: int = 8,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.stale_after_s = stale_after_s
        self.ping = ping
        self.ping_timeout_s = ping_timeout_s
        self.request_timeout_s = request_timeout_s
        self._ping_lock = threading.Lock()
        self._ping_thread: threading.Thread | None = None
        self._ping_started = 0.0
        self.started = time.time()  # a rank without a heartbeat is starting for stale_after_s after this
        self._server = _BoundedServer((host, port), self._handler_class(), max_connections)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def deep(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, JSON body) of the deep check."""
        ranks, dead = {}, []
        for rank in range(self.world_size):
            ok, text = rank_status(self.run_dir, rank, self.stale_after_s, watched_since=self.started)
            ranks[str(rank)] = text
            if not ok:
                dead.append(text)
        body: dict[str, Any] = {"ranks": ranks}
        if self.ping is not None:
            ok, text = self._ping_once()
            body["rollout"] = text
            if not ok:
                dead.append(f"rollout engine: {text}")
        body["status"] = "ok" if not dead else "unhealthy"
        body["dead"] = dead
        return not dead, body

    def _ping_once(self) -> tuple[bool, str]:
        """`ping_with_timeout`, but never two pings at once: while one is unanswered, a probe is
        answered "unhealthy" at once instead of stacking another thread on the engine."""
        with self._ping_lock:
            if self._ping_thread is not None and self._ping_thread.is_alive():
                waited = time.monotonic() - self._ping_started
                return False, f"no answer to ping within {self.ping_timeout_s:g} s (still waiting, {waited:.0f} s)"
            self._ping_started = time.monotonic()
            threads: list[threading.Thread] = []
            assert self.ping is not None  # only called when a ping was given
            result = ping_with_timeout(self.ping, self.ping_timeout_s, threads)
            self._ping_thread = threads[0] if threads else None
            return result

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = server.request_timeout_s  # socket timeout: a silent client frees its thread

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/healthz":
                    self._reply(200, {"status": "ok"})
                elif path == "/healthz/deep":
                    ok, body = server.deep()
                    self._reply(200 if ok else 503, body)
                else:
                    self._reply(404, {"status": "not found", "endpoints": ["/healthz", "/healthz/deep"]})

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                """Silent: probes every few seconds would flood the run's log."""

        return Handler

    def start(self) -> int:
        self._thread = threading.Thread(target=self._server.serve_forever, name="rltrain-health", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
