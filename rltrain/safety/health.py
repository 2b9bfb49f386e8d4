"""HTTP health endpoints on rank 0 (`health.port=N`), for a load balancer or a cluster's probes.

    GET /healthz       200 while the process lives (liveness: the HTTP thread answers)
    GET /healthz/deep  200 only when every rank's heartbeat is fresher than health.stale_after_s
                       and the rollout engine (if any) answers a ping; otherwise 503. The JSON body
                       names each rank's state and, under "dead", whatever failed.

stdlib `http.server` in a daemon thread: no dependency, and it keeps answering while the main
thread is busy or stuck in a collective (which is when a deep check is most useful). The ping runs
in its own thread with a timeout, so a hung rollout engine makes the check fail, not hang.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rltrain.safety.heartbeat import rank_status


def ping_with_timeout(ping: Callable[[], object], timeout_s: float) -> tuple[bool, str]:
    """(answered, detail). A ping that returns False, raises or takes longer than `timeout_s` fails."""
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = ping()
        except Exception as exc:  # noqa: BLE001 - any failure means "not healthy"
            result["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=call, name="rltrain-health-ping", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, f"no answer to ping within {timeout_s:g} s"
    if "error" in result:
        return False, f"ping failed: {result['error']}"
    if result.get("value") is False:
        return False, "ping returned False"
    return True, "ok"


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
    ) -> None:
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.stale_after_s = stale_after_s
        self.ping = ping
        self.ping_timeout_s = ping_timeout_s
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def deep(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, JSON body) of the deep check."""
        ranks, dead = {}, []
        for rank in range(self.world_size):
            ok, text = rank_status(self.run_dir, rank, self.stale_after_s)
            ranks[str(rank)] = text
            if not ok:
                dead.append(text)
        body: dict[str, Any] = {"ranks": ranks}
        if self.ping is not None:
            ok, text = ping_with_timeout(self.ping, self.ping_timeout_s)
            body["rollout"] = text
            if not ok:
                dead.append(f"rollout engine: {text}")
        body["status"] = "ok" if not dead else "unhealthy"
        body["dead"] = dead
        return not dead, body

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
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
