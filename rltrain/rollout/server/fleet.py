"""`rollout=server`: the rollout engine is a fleet of vLLM's own API servers reached over HTTP.

A batch's prompts (each a GRPO group: its `n` samples) are split into one contiguous run per
server that is up, each run one request (`/rltrain/generate`) to the server with the fewest out,
all chosen before any is sent (a group stays on one server, its prefix cache); every prompt is
seeded by its index in the batch, so a completion does not depend on which server produced it.
Trainer rank 0 pushes every new version to every server at once (rltrain/rollout/server/push.py:
gloo, or NCCL between GPUs) and keeps it as a host copy, so a server that comes back gets the
current weights before it serves again. Every completion carries the vLLM weight version that
sampled it; one from another version than the engine's stops the run. docs/rollout-servers.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rltrain.config.group_options import ServerRolloutConfig
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.images import PromptImages, check_batch
from rltrain.rollout.inflight_schedule import StreamOptions
from rltrain.rollout.server.batch_requests import answer_completions, batch_chunks, prompt_body
from rltrain.rollout.server.client import BATCH_PATH, ServerDown, call, is_up
from rltrain.rollout.server.extension import model_fingerprint
from rltrain.rollout.server.images import answered_prompt, model_image_token
from rltrain.rollout.server.process import stop_servers
from rltrain.rollout.server.push import buckets_of, checkpoint_weights, run_each
from rltrain.rollout.server.roster import (
    Server,
    all_down_message,
    given_servers,
    identify,
    join,
    not_answering,
    refuse_duplicates,
    spawn_servers,
)
from rltrain.rollout.server.routing_wire import model_is_moe
from rltrain.rollout.server.stream import FleetStream
from rltrain.runtime.errors import UserError


class FleetDown(UserError):
    """Every server stayed unreachable for `rollout.timeout_s`: one paragraph naming each (exit 2)."""


class ServerFleetEngine:
    """`RolloutEngine` over vLLM API servers (see the module doc)."""

    weights_survive_sleep = True  # the servers never sleep: time sharing is refused with rollout=server

    def __init__(
        self, cfg: ServerRolloutConfig, model_dir: str | Path, *, dtype: str, rank: int, cuda: bool,
        log_dir: Path, urls_from_rank0: Any = None, loads_group: Any = None, router_replay: bool = False,
    ) -> None:
        self.cfg = cfg
        # A MoE's routing is asked of the servers for every MoE (moe/router_agreement either way);
        # with router replay a completion without it stops the run (docs/moe.md).
        self.routing = model_is_moe(Path(model_dir))
        self.routing_required = router_replay
        # Generating ahead on several trainer ranks: a process group of the engine's worker threads,
        # so that no rank's push of a version lands while another rank still samples the batch of an
        # earlier one on the same servers (`update_weights`).
        self.loads_group = loads_group
        self.rank = rank
        self.cuda = cuda
        # The trainer's GPU, taken here on the main thread: NCCL pushes run on threads of their own.
        self.cuda_device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        self.model_dir = Path(model_dir)
        self.image_token = model_image_token(self.model_dir)  # None: a text-only model
        self.version = 0
        self.failures = 0
        self.observed: list[int] = []  # versions of the completions since the last `metrics()`
        self.current: list[tuple[torch.Tensor, list[list[Any]]]] | None = None  # rank 0: the pushed version
        self.lock = threading.Lock()  # the servers' up/outstanding state and `observed` (request threads, stream)
        self.stream: FleetStream | None = None  # in-flight updates (`request("stream_open")`)
        self.servers: list[Server] = []
        try:
            if rank == 0:
                self.servers = self._start_servers(dtype, log_dir)
            urls = [s.url for s in self.servers]
            if urls_from_rank0 is not None:  # every rank uses the servers rank 0 spawned
                urls = urls_from_rank0(urls)
                if rank != 0:
                    self.servers = [Server(u) for u in urls]
            if not self.servers:
                raise UserError(
                    "rollout=server has no servers: set rollout.servers.spawn=N (servers started on this machine) "
                    "and/or rollout.servers.urls=[http://host:port,...] (servers started with `python -m rltrain.serve`)."
                )
            self._form()
        except BaseException:
            self.close()
            raise

    # --- forming the fleet ----------------------------------------------------------------------

    def _start_servers(self, dtype: str, log_dir: Path) -> list[Server]:
        """Rank 0: the URL-given servers (each given once) and the ones this trainer spawns; a spawned
        one that fails to start is a server down (the others go on)."""
        servers = given_servers(list(self.cfg.servers.urls))
        for server, error in spawn_servers(self.cfg, self.model_dir, dtype, self.cuda, log_dir):
            servers.append(server)
            if error is not None:
                self.mark_down(server, error)
        return servers

    def _form(self) -> None:
        """Every rank: wait for the servers to answer. Rank 0: tell them apart (two URLs of one
        server are refused), join each and give it the checkpoint. A server that fails any of it is
        down, as one that dies mid-run: the others go on; none left, the fleet waits for one up to
        `rollout.timeout_s` (docs/rollout-servers.md, "Failure behaviour")."""
        wait_s = self.cfg.servers.start_timeout_s
        for server in not_answering([s for s in self.servers if s.up], wait_s):
            self.mark_down(server, f"no answer to /health within rollout.servers.start_timeout_s={wait_s:g}s")
            print(f"rltrain: rollout server {server.url} does not answer, going on without it for now", flush=True)
        if self.rank == 0:
            up = [s for s in self.servers if s.up]
            errors = run_each([partial(identify, server, self.cfg.timeout_s) for server in up])
            self._down_or_raise(up, errors)
            refuse_duplicates(self.servers)
            up = [s for s in self.servers if s.up]
            expected, buckets = model_fingerprint(self.model_dir), self._current_buckets()
            self._down_or_raise(up, run_each([partial(self._join, server, expected, buckets) for server in up]))
        if not any(s.up for s in self.servers):
            self._await_any(time.monotonic() + self.cfg.timeout_s)

    def _down_or_raise(self, servers: list[Server], errors: list[BaseException | None]) -> None:
        """A server's failure (`ServerDown`) marks it down; any other error is raised."""
        for server, error in zip(servers, errors, strict=True):
            if isinstance(error, ServerDown):
                self.mark_down(server, str(error))
                print(f"rltrain: rollout server {server.url} failed while the fleet formed, going on without it for now: "
                      f"{str(error)[:300]}", flush=True)
        for error in errors:
            if error is not None and not isinstance(error, ServerDown):
                raise error

    def _await_any(self, deadline: float) -> None:
        """No server is up: ask the down ones again until one is, or raise FleetDown at `deadline`."""
        while not any(s.up for s in self.servers):
            if time.monotonic() > deadline:
                raise FleetDown(self._all_down_message())
            time.sleep(1.0)
            with self.lock:
                self.revive()

    # --- servers --------------------------------------------------------------------------------

    def _current_buckets(self) -> list[tuple[torch.Tensor, list[list[Any]]]]:
        """The version servers that (re)join get: the pushed one, else the checkpoint (version 0),
        read once for all the servers that join together."""
        if self.current is not None:
            return self.current
        return list(buckets_of(checkpoint_weights(self.model_dir), self.cfg.bucket_mb << 20))

    def _join(self, server: Server, expected: dict[str, str], buckets: list[tuple[torch.Tensor, list[list[Any]]]]) -> None:
        join(server, self.cfg, self.model_dir, self.cuda_device, expected, buckets, self.version)

    def mark_down(self, server: Server, reason: str) -> None:
        """`server` failed: down, counted, `reason` kept for the all-down message (takes `lock`)."""
        with self.lock:
            if server.up:
                server.up = False
                server.down_since = time.monotonic()
                self.failures += 1
            server.reasons.append(reason)

    def revive(self) -> None:
        """Down servers that answer again: rank 0 re-joins them and pushes the current version
        before they serve (several at once); other ranks take them back once they report that version.
        Call under `lock`."""
        back = [server for server in self.servers if not server.up and is_up(server.url)]
        if self.rank != 0:
            for server in back:
                try:
                    server.up = self._server_version(server) == self.version
                except ServerDown as exc:
                    server.reasons.append(str(exc))
            return
        if not back:
            return
        identified = self._still_up(back, run_each([partial(identify, server, self.cfg.timeout_s) for server in back]))
        refuse_duplicates(self.servers)
        if not identified:
            return
        expected, buckets = model_fingerprint(self.model_dir), self._current_buckets()
        joined = self._still_up(identified, run_each([partial(self._join, server, expected, buckets) for server in identified]))
        for server in joined:
            server.up = True

    def _still_up(self, servers: list[Server], errors: list[BaseException | None]) -> list[Server]:
        """The down `servers` whose step went through; a `ServerDown` is kept as a reason, any other error raised."""
        for error in errors:
            if error is not None and not isinstance(error, ServerDown):
                raise error
        for server, error in zip(servers, errors, strict=True):
            if error is not None:
                server.reasons.append(str(error))
        return [server for server, error in zip(servers, errors, strict=True) if error is None]

    def _server_version(self, server: Server) -> int:
        answer = call(server.url, "/weight_info", None, self.cfg.timeout_s)
        try:
            return int(answer["weight_version"])
        except (TypeError, ValueError):
            return -1

    def pick(self, deadline: float) -> Server:
        """The up server with the fewest requests out, its count raised (the caller lowers it under
        `lock`); none up, the down ones are asked again until `deadline`, then FleetDown."""
        while True:
            with self.lock:
                up = [s for s in self.servers if s.up]
                if up:
                    server = min(up, key=lambda s: s.outstanding)
                    server.outstanding += 1
                    return server
            self._await_any(deadline)

    def _all_down_message(self) -> str:
        return all_down_message(self.servers, self.cfg.timeout_s)

    # --- RolloutEngine --------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, images: list[PromptImages] | None = None
    ) -> list[Completion]:
        check_batch(prompts, images)
        with self.lock:
            self.revive()
        if self.rank != 0:  # rank 0's push may still be under way: wait for the version
            self._await_version()
        deadline = time.monotonic() + self.cfg.timeout_s
        chunks = batch_chunks(len(prompts), sum(s.up for s in self.servers))
        firsts: list[Server] = []
        try:
            for _ in chunks:
                firsts.append(self.pick(deadline))
        except FleetDown:
            with self.lock:
                for server in firsts:
                    server.outstanding -= 1
            raise
        with ThreadPoolExecutor(max_workers=max(1, len(chunks))) as pool:
            results = list(pool.map(lambda chunk, first: self._request(chunk, first, prompts, sampling, deadline, images),
                                    chunks, firsts))
        return [c for group in results for c in group]

    def _await_version(self) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        for server in self.servers:
            while server.up:
                try:
                    if self._server_version(server) >= self.version:
                        break
                except ServerDown as exc:
                    self.mark_down(server, str(exc))
                    break
                if time.monotonic() > deadline:
                    self.mark_down(server, f"still not at version {self.version} after {self.cfg.timeout_s:g}s")
                    break
                time.sleep(0.05)

    def _request(
        self, indices: range, first: Server, prompts: list[list[int]], sampling: SamplingSettings, deadline: float,
        images: list[PromptImages] | None,
    ) -> list[Completion]:
        """The prompts `indices` in one request (batch_route.py) to `first` (picked, its count raised),
        each with its own seed; a server that fails it is marked down, another asked."""
        salt = self.stream.salt(self.version) if self.stream is not None else None  # prefix caches outlive versions
        bodies = [
            prompt_body(i, prompts[i], sampling, images[i] if images else None, self.image_token, salt) for i in indices
        ]
        server = first
        while True:
            try:
                answer = call(server.url, BATCH_PATH, {"requests": bodies, "routing": self.routing}, self.cfg.timeout_s)
            except ServerDown as exc:
                self.mark_down(server, str(exc))
                answer = None
            finally:
                with self.lock:
                    server.outstanding -= 1
            if answer is None:
                server = self.pick(deadline)
                continue
            server.served += 1
            completions = [
                c for i, one in zip(indices, answer["answers"], strict=True)
                for c in answer_completions(
                    i, one, server.url, self.version, answered_prompt(i, prompts[i], one, self.image_token),
                    self.routing_required,
                )
            ]
            with self.lock:
                self.observed.extend([self.version] * len(completions))
            return completions

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0 pushes the version to every server that is up, all at once (a failed push marks
        that server down; it gets this version when it comes back); other ranks count the version."""
        self.version += 1
        if self.rank != 0:
            deque(weights, maxlen=0)  # the export is a collective: every rank consumes it
            self._every_rank_loads()
            return
        self.current = list(buckets_of(weights, self.cfg.bucket_mb << 20))
        self._every_rank_loads()
        targets = [(server, server.pusher) for server in self.servers if server.up and server.pusher is not None]
        hold = self.stream is not None  # in flight: requests held between two decoding steps for the load
        errors = run_each([partial(pusher.push, self.current, self.version, hold) for _, pusher in targets])
        for (server, _), error in zip(targets, errors, strict=True):
            if isinstance(error, ServerDown):
                self.mark_down(server, str(error))
        for error in errors:
            if error is not None and not isinstance(error, ServerDown):
                raise error
        if self.stream is not None:
            self.stream.loaded(self.version)

    # --- in-flight updates (rltrain/rollout/server/stream.py) ------------------------------------

    def request(self, op: str, **fields: Any) -> Any:
        """The in-flight mode's ops (`stream_open`, `submit`, `take`: rltrain/algos/rl/inflight_rollouts.py),
        served by the fleet's stream; `stream_open` labels the servers' weights with the trainer's version."""
        if op == "stream_open":
            self.stream = FleetStream(self, StreamOptions(**fields["options"]))
            return None
        if self.stream is None:
            raise RuntimeError(f"{op!r} before stream_open")
        return self.stream.request(op, **fields)

    def post(self, op: str, **fields: Any) -> int:
        """`request` in two halves, as the separate engine's: the prompts that travel with a `take`
        are queued now; the batch is waited for in `reply` (the stream needs no early ask: its
        batches are filled by the request threads whoever waits)."""
        if self.stream is None:
            raise RuntimeError(f"{op!r} before stream_open")
        return self.stream.post(op, **fields)

    def reply(self, request_id: int) -> Any:
        assert self.stream is not None
        return self.stream.reply(request_id)

    def observe(self, versions: list[int]) -> None:
        """The versions `metrics()` reports for the step: its batch's tokens (in flight)."""
        with self.lock:
            self.observed = list(versions)

    def _every_rank_loads(self) -> None:
        """Generating ahead, each rank's load of a version runs on its engine's worker thread after
        the batches queued before it: a barrier of those threads holds rank 0's push until every
        rank sampled its batches of the earlier version (a multi-turn batch may take a whole step)."""
        if self.loads_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.loads_group)

    def metrics(self) -> dict[str, float]:
        """The fleet now, and the versions of the completions sampled since the last call (a
        multi-turn episode's completion is assembled from several; a single-turn batch generated
        ahead is measured from its own completions instead: rltrain/algos/rl/algorithm.py)."""
        with self.lock:
            observed, self.observed = self.observed, []
        return {
            # Nothing sampled here (a model-parallel replica's follower): neutral for the reduction.
            "rollout/version_min": float(min(observed, default=float("inf"))),
            "rollout/version_max": float(max(observed, default=float("-inf"))),
            "rollout/servers_up": float(sum(s.up for s in self.servers)),
            "rollout/server_failures": float(self.failures),
        }

    def sleep(self) -> None:
        raise RuntimeError("rollout=server never sleeps: time sharing is refused for it at config time")

    def wake(self) -> None:
        raise RuntimeError("rollout=server never sleeps: time sharing is refused for it at config time")

    def ping(self) -> bool:
        """True when at least one server answers `/health`."""
        if not any(is_up(s.url) for s in self.servers):
            raise FleetDown(self._all_down_message())
        return True

    def close(self) -> None:
        """Stop the servers this trainer spawned; URL-given servers are never stopped."""
        if self.stream is not None:
            self.stream.close()
        stop_servers([server.spawned for server in self.servers if server.spawned is not None])
        for server in self.servers:
            server.spawned = None
