"""In-flight updates over the server fleet (`placement.weight_update=in_flight` with `rollout=server`).

The fleet serves the separate engine's stream ops (`stream_open`, `submit`, `take`:
rltrain/algos/rl/inflight_rollouts.py). Groups enter as the shared admission rule allows
(rltrain/rollout/inflight_schedule.py), each one request of its `n` samples on a thread of its own;
a version is pushed while they run, each server holding its requests between two decoding steps
for the load (push.py, `hold_requests`), and every token comes back labelled with the version that
sampled it. A group holding a token too old for its batch is generated again; a failed server costs
its requests only (sent whole to another). docs/async.md, "Over servers".
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from typing import Any, Protocol

from rltrain.config.group_options import ServerRolloutConfig
from rltrain.rollout.inflight_schedule import (
    Admission,
    Group,
    StreamOptions,
    TakeBook,
    entry_room,
    oldest_trained_version,
    submitted_group,
)
from rltrain.rollout.server.batch_requests import no_record_message
from rltrain.rollout.server.client import BATCH_PATH, ServerDown, call
from rltrain.rollout.server.roster import Server
from rltrain.rollout.server.routing_wire import decode_routing
from rltrain.runtime.errors import UserError

PROGRESS_TICK_S = 1.0  # how often a waiting `take` looks at the fleet


class Fleet(Protocol):
    """What the stream uses of its fleet (rltrain/rollout/server/fleet.py, `ServerFleetEngine`)."""

    version: int
    servers: list[Server]
    cfg: ServerRolloutConfig
    lock: threading.Lock
    routing: bool  # a MoE: each group goes through rltrain's batch route, which answers its routing
    routing_required: bool  # router replay: a completion without a record stops the run

    def revive(self) -> None:
        """Down servers that answer again rejoin with the current version (call under `lock`)."""

    def pick(self, deadline: float) -> Server:
        """The up server with the fewest requests out, its count raised; waits for one until `deadline`."""

    def mark_down(self, server: Server, reason: str) -> None:
        """`server` failed: down, counted, `reason` kept for the all-down message."""

    def ping(self) -> bool:
        """True when a server answers."""

    def observe(self, versions: list[int]) -> None:
        """The token versions `metrics()` reports for the step."""


class FleetStream:
    """The in-flight loop of a fleet (see the module doc); `request` is its ops."""

    def __init__(self, fleet: Fleet, opts: StreamOptions) -> None:
        self.fleet, self.opts = fleet, opts
        self.cond = threading.Condition()
        self.book = TakeBook(opts.per_step, opts.max_staleness, opts.stream, opts.first_step)
        self.version = opts.version  # the version every server that is up holds
        self.backlog: deque[Group] = deque()
        self.running: set[int] = set()  # keys of the groups whose request is out
        self.keys = 0
        self.dropped: dict[int, int] = {}  # step -> groups generated again because too stale for it
        self.error: BaseException | None = None
        self.closed = False
        self.idle_s = self.busy_s = 0.0
        self.since = time.perf_counter()
        self.progress = time.monotonic()
        self.nonce = uuid.uuid4().hex[:12]  # this stream's: a server may hold the prompt KV of a killed run's
        self.posted = 0
        self.posted_steps: dict[int, int] = {}  # `take`s posted, not answered: request id -> step
        self._relabel(opts.version)
        self.dispatcher = threading.Thread(target=self._dispatch, name="rltrain-fleet-stream", daemon=True)
        self.dispatcher.start()

    def _relabel(self, version: int) -> None:
        """The servers hold the trainer's current weights, labelled by the fleet's count of pushes;
        label them with the trainer's version (a resumed run's: its checkpoint's step) so that every
        token carries it."""
        fleet = self.fleet
        if version == fleet.version:
            return
        fleet.version = version
        for server in fleet.servers:
            if server.up:
                try:
                    call(server.url, "/update_weight_version", {"new_version": str(version)}, fleet.cfg.timeout_s)
                except ServerDown as exc:
                    fleet.mark_down(server, str(exc))

    # --- ops --------------------------------------------------------------------------------------

    def request(self, op: str, **fields: Any) -> Any:
        if op == "submit":
            self._enqueue(fields["groups"])
            return None
        if op == "take":  # the prompts that travel with it are queued first
            self._enqueue(fields.get("groups", []))
            return self._take(int(fields["step"]))
        if op == "ping":
            return self.fleet.ping()
        if op == "close":
            self.close()
            return None
        raise RuntimeError(f"{op!r} is not served by the fleet's stream")

    def post(self, op: str, **fields: Any) -> int:
        """A `take` posted ahead: its prompts queued now, its batch waited for by `reply`."""
        if op != "take":
            raise RuntimeError(f"only 'take' is posted to the fleet's stream, not {op!r}")
        self._enqueue(fields.get("groups", []))
        self.posted += 1
        self.posted_steps[self.posted] = int(fields["step"])
        return self.posted

    def reply(self, request_id: int) -> Any:
        return self._take(self.posted_steps.pop(request_id))

    def _enqueue(self, rows: list[dict[str, Any]]) -> None:
        with self.cond:
            for row in rows:
                self.keys += 1
                self.backlog.append(submitted_group(row, self.keys, self.opts.group_size))
            self.cond.notify_all()

    def salt(self, version: int) -> str:
        """A prompt's cache salt: a server cannot reset its prefix cache while requests are held
        (push.py), so no prompt KV cached under one version (or by another run) is reused by a
        request that entered under another."""
        return f"rltrain-{self.nonce}-v{version}"

    def loaded(self, version: int) -> None:
        """The trainer's thread: every server that is up holds `version` now (groups may enter)."""
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def close(self) -> None:
        """Stop admitting; requests still out finish on their servers and are not read."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # --- the batch ----------------------------------------------------------------------------------

    def _take(self, step: int) -> dict[str, Any]:
        """Step `step`'s groups once the book holds them all (the trainer's thread). A down server
        is asked here whether it is back: it rejoins with the current version before it serves."""
        with self.fleet.lock:
            self.fleet.revive()
        with self.cond:
            self.progress = time.monotonic()  # the bound counts from here: the trainer may have been away long
            while not self.book.full(step):
                self._check(step)
                self.cond.wait(PROGRESS_TICK_S)
            self._account()
            groups = self.book.pop(step)
            result = {
                "groups": [
                    {"index": g.index, "token_ids": g.token_ids, "logprobs": g.logprobs, "versions": g.versions,
                     "finished": g.finished, "routing": g.routing} for g in groups
                ],
                "idle_s": self.idle_s, "busy_s": self.busy_s, "dropped": self.dropped.pop(step, 0),
            }
            self.idle_s = self.busy_s = 0.0
        # The versions of the tokens the step trains (older ones are masked: partial rollouts, as the
        # trainer does); a batch of empty completions only: the version it was taken under.
        oldest_trained = oldest_trained_version(step, self.opts.max_staleness)
        self.fleet.observe([v for g in groups for vs in g.versions for v in vs if v >= oldest_trained] or [self.version])
        return result

    def _check(self, step: int) -> None:
        """Raise what a request thread met, or a stream that cannot progress (a bound: a request
        is bounded by `rollout.timeout_s`, so a batch that sees no request start or end for twice
        that is stuck)."""
        if self.error is not None:
            raise self.error
        bound = 2 * self.fleet.cfg.timeout_s
        if time.monotonic() - self.progress > bound:
            raise RuntimeError(
                f"rollout=server, in flight: step {step}'s batch saw no request start or end in {bound:g}s "
                f"({len(self.running)} requests out, {len(self.backlog)} groups waiting, version {self.version})"
            )

    def _account(self) -> None:
        """Split the time since the last look into busy (a request out) and idle (none)."""
        now = time.perf_counter()
        if self.running:
            self.busy_s += now - self.since
        else:
            self.idle_s += now - self.since
        self.since = now

    # --- admission and requests --------------------------------------------------------------------

    def _dispatch(self) -> None:
        with self.cond:
            while not self.closed and self.error is None:
                while self.backlog and self._room(self.backlog[0]) > 0:
                    group = self.backlog.popleft()
                    self._account()
                    self.running.add(group.key)
                    self.progress = time.monotonic()
                    threading.Thread(target=self._run, args=(group, self.version), daemon=True).start()
                self.cond.wait()

    def _room(self, group: Group) -> int:
        """How many more groups may start now, `group` the next (the shared rule)."""
        o, book = self.opts, self.book
        state = Admission(self.version, book.filling, book.taken(book.filling), len(self.running), o.per_step, o.max_staleness, o.stream)
        return entry_room(state, group.step)

    def _run(self, group: Group, version: int) -> None:
        """One group's request, on its own thread; its outcome is booked under the lock."""
        try:
            choices = self._generate(group, version)
            fill(group, choices, self.fleet.version, self.fleet.routing_required)  # counted before its push starts
        except BaseException as exc:  # noqa: BLE001 - raised on the trainer's thread by `take`
            with self.cond:
                self.error = self.error or exc
                self.cond.notify_all()
            return
        with self.cond:
            self._account()
            self.running.discard(group.key)
            self.progress = time.monotonic()
            if not self.book.place(group, self.version, 0):
                target = self.book.filling if self.opts.stream else group.step
                self.dropped[target] = self.dropped.get(target, 0) + 1  # counted in the batch it could not join
                self.keys += 1
                self.backlog.appendleft(group.again(self.keys))
            self.cond.notify_all()

    def _generate(self, group: Group, version: int) -> list[dict[str, Any]]:
        """The group's `n` samples from one server, the prompt salted with the version it enters
        under (`salt`); a server that fails is marked down and the request goes whole to another.
        A MoE's group goes alone through rltrain's batch route, whose choices carry the routing
        record too (docs/moe.md, "Recording in a server")."""
        s = self.opts.sampling
        body = {
            "token_ids": group.prompt_ids, "cache_salt": self.salt(version),
            "sampling_params": {
                "n": group.n, "temperature": s["temperature"], "top_p": s["top_p"], "max_tokens": s["max_new_tokens"],
                "seed": group.seed, "stop_token_ids": sorted(set(s["stop_token_ids"])) or None, "logprobs": 0,
                "detokenize": False,
            },
        }
        while True:
            server = self.fleet.pick(time.monotonic() + self.fleet.cfg.timeout_s)
            try:
                if self.fleet.routing:
                    answer = call(server.url, BATCH_PATH, {"requests": [body], "routing": True}, self.fleet.cfg.timeout_s)
                    answer = answer["answers"][0]
                else:
                    answer = call(server.url, "/inference/v1/generate", body, self.fleet.cfg.timeout_s)
            except ServerDown as exc:
                self.fleet.mark_down(server, str(exc))
                continue
            finally:
                with self.fleet.lock:
                    server.outstanding -= 1
            server.served += 1
            return [dict(c, server=server.url) for c in sorted(answer["choices"], key=lambda c: c["index"])]


def fill(group: Group, choices: list[dict[str, Any]], current: int, routing_required: bool = False) -> None:
    """A group's samples from a server's answer: token ids, log-probabilities, and each token's
    version from vLLM's spans (output tokens [start, end) sampled by the weights labelled
    `version`). A label that is not a version this stream pushed (none, another trainer's, a
    server restarted without the weights) stops the run, naming the server; so does a choice
    without a routing record where router replay needs one. Log-probabilities come as vLLM's
    entries (`/inference/v1/generate`) or a flat list (rltrain's batch route)."""
    group.token_ids, group.logprobs, group.versions, group.finished, group.routing = [], [], [], [], []
    for choice in choices:
        token_ids = [int(t) for t in choice["token_ids"]]
        versions: list[int] = []
        for span in choice.get("weight_versions") or []:
            label = str(span["version"])
            if not label.isdigit() or int(label) > current:
                raise UserError(
                    f"rollout=server: {choice['server']} sampled tokens with weight version {label!r}, which this run never "
                    f"pushed (it holds version {current}): another trainer pushes weights into it, or it restarted "
                    "without them. Give each run its own servers (rollout.servers.urls)."
                )
            versions += [int(label)] * (int(span["end"]) - int(span["start"]))
        if len(versions) != len(token_ids):
            raise UserError(
                f"rollout=server: {choice['server']} labelled {len(versions)} of {len(token_ids)} tokens with a weight "
                "version; in-flight updates need vLLM's weight-version spans (vLLM >= 0.32, the server started by rltrain)."
            )
        group.token_ids.append(token_ids)
        logprobs = choice["logprobs"]
        group.logprobs.append([float(x) for x in logprobs] if isinstance(logprobs, list) else [float(e["logprob"]) for e in logprobs["content"]])
        wire = choice.get("routing")
        if wire is None and routing_required:
            raise UserError(no_record_message(choice["server"]))
        group.routing.append(None if wire is None else decode_routing(wire).tolist())
        group.versions.append(versions)
        group.finished.append(choice["finish_reason"] == "stop")
    group.done = len(choices)
