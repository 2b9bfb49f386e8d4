"""The per-rank safety services of a run (heartbeat, hang watchdog, health server, the step its
fault injector is on), behind the few calls the training loop makes (`SafetyServices`).

The guard and the optimizer step need the model and live in the backends; this module holds what
only needs the run directory and the clock. The call sequence: docs/internals/safety.md.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rltrain.config.run_context import RunContext
from rltrain.runtime.errors import peer_reported
from rltrain.safety.error_kinds import is_collective_failure
from rltrain.safety.health import HealthServer
from rltrain.safety.heartbeat import Heartbeat, describe_lost_peers
from rltrain.safety.watchdog import Watchdog

# A peer that died a moment ago may still have a fresh heartbeat (beats are 1 s apart): wait up to
# this long for the evidence before naming who was lost.
LOST_PEER_EVIDENCE_S = 4.0


class SafetyServices:
    def __init__(self, ctx: RunContext, ping: Callable[[], object] | None = None) -> None:
        cfg = ctx.cfg
        self.cfg = cfg
        self.run_dir = Path(ctx.run_dir)
        self.rank = ctx.dist.rank
        self.world_size = ctx.dist.world_size
        self.injector = ctx.faults
        self.heartbeat = Heartbeat(self.run_dir, self.rank)
        hang = cfg.health.hang_timeout_s
        self.watchdog = Watchdog(self.run_dir, self.rank, hang) if hang and hang > 0 else None
        self.ping = self.injector.wrap_ping(ping)
        self.server: HealthServer | None = None

    def start(self) -> None:
        self.heartbeat.start()
        if self.watchdog is not None:
            self.watchdog.start()
        health = self.cfg.health
        if self.rank == 0 and health.port is not None:
            self.server = HealthServer(
                self.run_dir,
                self.world_size,
                health.stale_after_s,
                port=health.port,
                host=health.host,
                ping=self.ping,
                ping_timeout_s=health.ping_timeout_s,
            )
            port = self.server.start()
            (self.run_dir / "health.json").write_text(json.dumps({"host": health.host, "port": port}))
            print(f"rltrain: health endpoints on http://{health.host}:{port}/healthz and /healthz/deep", flush=True)

    def before_step(self, step: int) -> None:
        self.injector.set_step(step)
        self.heartbeat.beat(step)
        self.injector.maybe_kill()

    def progress(self) -> None:
        self.heartbeat.progress()

    def after_step(self, step: int) -> None:
        self.heartbeat.beat(step, finished=True)
        if self.watchdog is not None:
            self.watchdog.progress()

    def explain_failure(self, exc: BaseException) -> None:
        """When a collective failed, print which peer was lost (from the heartbeats) in one line."""
        if not is_collective_failure(exc) or self.world_size == 1:
            return
        if peer_reported(self.run_dir, self.rank):
            return  # a peer's user error is the cause: it is reported once, by the launcher
        deadline = time.monotonic() + LOST_PEER_EVIDENCE_S
        story = describe_lost_peers(self.run_dir, self.world_size, self.rank)
        while not story.startswith("lost") and time.monotonic() < deadline:
            time.sleep(0.5)
            story = describe_lost_peers(self.run_dir, self.world_size, self.rank)
        print(
            f"rltrain: rank {self.rank}: a collective failed ({type(exc).__name__}); {story}. "
            f"Stopping this rank (non-zero exit).",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.watchdog is not None:
            self.watchdog.stop()
        self.heartbeat.stop()
