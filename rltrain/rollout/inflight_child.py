"""The rollout process's in-flight mode (`placement.weight_update=in_flight`): vLLM driven step by step.

After `stream_open` the child stops answering whole `generate` calls and runs its own loop: it
admits submitted prompts into vLLM's `LLMEngine` as they fit, calls `step()`, tags every new token
with the policy version the engine holds, and between two steps takes what the trainer sent: new
weights (loaded in place; the requests in flight keep their KV cache), prompts, a request for a
step's batch (answered when that batch is complete), an evaluation. With `deterministic` a version
is applied at the decode step the schedule names (rltrain/rollout/inflight_schedule.py), waiting
for the weights if they are late, and nothing else that arrives changes what is sampled when.
docs/async.md, "Weights in flight", has the modes and the guarantees.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from rltrain.rollout import vllm_routing
from rltrain.rollout.inflight_io import Inbox, Outbox
from rltrain.rollout.inflight_routing import StreamRecords
from rltrain.rollout.inflight_schedule import (
    Admission,
    Group,
    StreamOptions,
    TakeBook,
    admit_count,
    due_step,
    entry_room,
    submitted_group,
)
from rltrain.rollout.seeds import request_seed

if TYPE_CHECKING:
    from rltrain.rollout.control_wire import ControlChannel
    from rltrain.rollout.vllm import VLLMRolloutEngine
    from rltrain.transport.receiver import WeightReceiver


class StreamLoop:
    """The loop itself; `run` returns when the trainer closes the channel or asks to close."""

    def __init__(self, channel: ControlChannel, engine: VLLMRolloutEngine, receiver: WeightReceiver, opts: StreamOptions) -> None:
        self.engine, self.opts = engine, opts
        self.outbox = Outbox(channel)
        self.inbox = Inbox(channel, receiver, self.outbox)
        self.core = engine._live().llm_engine
        scheduler = self.core.vllm_config.scheduler_config
        self.max_num_seqs, self.token_budget = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
        self.book = TakeBook(opts.per_step, opts.max_staleness, opts.stream, opts.first_step)
        self.version, self.decode_steps, self.keys = opts.version, 0, 0
        self.backlog: deque[Group] = deque()
        self.live: dict[str, Group] = {}  # vLLM request id -> its group (one request of `n` samples)
        self.running = 0  # sequences started and not finished
        self.live_groups: set[int] = set()
        self.submitted = 0
        self.dropped: dict[int, int] = {}  # step -> groups generated again because too stale for it
        self.weights: dict[int, list[Any]] = {}  # received, not applied yet
        self.take: tuple[int, int] | None = None  # (request id, step) waiting for its batch
        self.evaluation: dict[str, Any] | None = None  # running
        self.held_evaluation: dict[str, Any] | None = None  # arrived, not started
        self.evaluated = {opts.version}  # its evaluation, if any, came before the stream opened
        self.idle_s, self.busy_s, self.closed = 0.0, 0.0, False
        self.records = self._records()  # router replay's record (a MoE on vLLM's CPU build), else None

    def _records(self) -> StreamRecords | None:
        """Arm the engine's routing tap for the loop's keyed requests (rltrain/rollout/inflight_routing.py)."""
        if not self.engine.records_routing:
            return None
        llm = self.engine._live()
        llm.collective_rpc(vllm_routing.arm_keyed)
        return StreamRecords(lambda keys: llm.collective_rpc(vllm_routing.take_keys, args=(keys,))[0])

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        while not self.closed:
            self._messages()
            if self.closed:
                return
            if self._must_wait():
                self._idle()
                continue
            if self._apply_versions(idle=False):
                continue  # what is due after it (an evaluation) is checked first
            self._admit()
            if self.core.has_unfinished_requests():
                started = time.perf_counter()
                self._step()
                self.busy_s += time.perf_counter() - started
            elif not self._apply_versions(idle=True):
                self._idle()

    def _idle(self) -> None:
        """Nothing to step: wait for the next message (the wait counted in `rollout/engine_idle_frac`,
        what it brings, a version's load say, as busy)."""
        started = time.perf_counter()
        message = self.inbox.queue.get()
        self.idle_s += time.perf_counter() - started
        self._handle_all(message)

    def _must_wait(self) -> bool:
        """Deterministic: hold the next decode step while something it depends on has not arrived
        (a due version's weights, the evaluation of a just-applied version, the next prompts)."""
        if not self.opts.deterministic or self.evaluation is not None:
            return False  # an evaluation in progress is stepped to its end (the trainer waits for it)
        if self._evaluation_due():  # first: the trainer sends it before anything else
            return self.held_evaluation is None
        due = due_step(self.book.filled_at, self.version + 1, self.opts.lag_steps)
        if due is not None and self.decode_steps >= due and self.version + 1 not in self.weights:
            return True
        return not self.backlog and self.submitted < self.opts.expected_groups and self._would_admit_next()

    def _evaluation_due(self) -> bool:
        return self.version in self.opts.eval_versions and self.version not in self.evaluated

    def _would_admit_next(self) -> bool:
        return self._room(self.opts.first_step + self.submitted // self.opts.per_step) > 0

    def _room(self, step: int) -> int:
        """How many more groups may start now, the next of step `step`'s prompts (the shared rule)."""
        o, book = self.opts, self.book
        state = Admission(self.version, book.filling, book.taken(book.filling), len(self.live_groups), o.per_step, o.max_staleness, o.stream)
        return entry_room(state, step)

    # --- messages -------------------------------------------------------------------------------

    def _messages(self) -> None:
        """Handle what has arrived, without waiting."""
        try:
            self._handle_all(self.inbox.queue.get_nowait())
        except queue.Empty:
            return

    def _handle_all(self, message: dict[str, Any]) -> None:
        """Handle `message` and every one queued behind it."""
        try:
            while True:
                self._handle(message)
                if self.closed:
                    return
                message = self.inbox.queue.get_nowait()
        except queue.Empty:
            return

    def _handle(self, message: dict[str, Any]) -> None:
        op, request_id = message["op"], message["id"]
        done = {"op": "reply", "id": request_id, "ok": True}
        reply: dict[str, Any] | None = done
        if op == "_weights":  # the next version, received (and answered) by the inbox: applied between two decode steps
            self.weights[self.version + 1 + len(self.weights)] = message["weights"]
            if not self.opts.deterministic:
                self._apply_versions(idle=True)  # between two decode steps: the requests in flight go on
            reply = None
        elif op == "_closed":
            self.closed, reply = True, None
        elif op == "_failed":
            raise message["error"]
        elif op == "submit":
            self._enqueue(message["groups"])
        elif op == "take":  # the prompts that travel with it are queued first
            self._enqueue(message.get("groups", []))
            self.take, reply = (request_id, int(message["step"])), None
            self._answer_take()
        elif op == "generate":  # an evaluation: started at once, or (deterministic) once its version is loaded
            self.held_evaluation, reply = {"id": request_id, **message}, None
        elif op == "ping":
            reply = {**done, "result": self.engine.ping()}
        elif op == "close":
            self.closed = True
        else:
            reply = {"op": "reply", "id": request_id, "ok": False, "error": f"{op!r} is not served while streaming"}
        if reply is not None:
            self.outbox.send(reply)

    def _enqueue(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.keys += 1
            self.backlog.append(submitted_group(row, self.keys, self.opts.group_size))
        self.submitted += len(rows)

    # --- versions, admission, steps -------------------------------------------------------------

    def _apply_versions(self, idle: bool) -> bool:
        """Load the received versions that are due: at once without `deterministic`; with it at
        their decode step, or when the engine has nothing to step (then nothing could differ).
        True when one was applied."""
        applied = False
        while self.version + 1 in self.weights:
            due = due_step(self.book.filled_at, self.version + 1, self.opts.lag_steps)
            if self.opts.deterministic and (self.evaluation is not None or not idle and (due is None or self.decode_steps < due)):
                break  # deterministic: at its decode step, once no evaluation is in progress
            started = time.perf_counter()
            self.engine.update_weights(self.weights.pop(self.version + 1))
            self.busy_s += time.perf_counter() - started  # the engine works: not idle, whoever waits on it
            self.version += 1
            applied = True
            if self._evaluation_due() and self.opts.deterministic:
                break  # its evaluation is admitted before any other step (`_must_wait`)
        return applied

    def _admit(self) -> None:
        if self.held_evaluation is not None and self.evaluation is None and (not self.opts.deterministic or self._evaluation_due()):
            self.evaluation, self.held_evaluation = self.held_evaluation, None
            self._start_evaluation()
        if self.evaluation is not None:
            self._admit_evaluation()
            if self.opts.deterministic:
                return  # no training prompt enters during an evaluation: its start and end are counts, the prompts' arrival is not
        heads: list[Group] = []
        for group in self.backlog:
            if len(heads) >= self._room(group.step):
                break
            heads.append(group)
        count = admit_count(self.running, [len(g.prompt_ids) for g in heads], self.opts.group_size, self.max_num_seqs, self.token_budget)
        for _ in range(count):
            self._add(self.backlog.popleft())

    def _add(self, group: Group) -> None:
        self._request(f"g{group.key}", group, self.opts.sampling, recorded=self.records is not None)
        self.live_groups.add(group.key)

    def _request(self, request_id: str, group: Group, sampling: dict[str, Any], recorded: bool = False) -> None:
        """One request of the group's `n` samples: vLLM seeds sample j with `seed + j`, as the batch
        `generate` does (rltrain/rollout/vllm.py), and checks the prompt once, not `n` times.
        `recorded`: the tap keeps its routing under its id (a training request of a MoE)."""
        extra = StreamRecords.extra_args(request_id) if recorded else None
        self.core.add_request(request_id, self._prompt(group), self._params(group.seed, group.n, sampling, extra))
        self.live[request_id] = group
        self.running += group.n

    def _prompt(self, group: Group) -> dict[str, Any]:
        """The prompt salted with the version loaded now: a request reuses only prompt KV cached
        under the same version (vLLM cannot reset its prefix cache while requests run)."""
        return {"prompt_token_ids": group.prompt_ids, "cache_salt": f"v{self.version}"}

    def _params(self, seed: int, n: int, s: dict[str, Any], extra_args: dict[str, Any] | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=n, temperature=s["temperature"], top_p=s["top_p"], max_tokens=s["max_new_tokens"], seed=seed,
            stop_token_ids=sorted(set(s["stop_token_ids"])) or None, logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA, extra_args=extra_args,
        )

    def _step(self) -> None:
        outputs = self.core.step()
        self.decode_steps += 1
        for out in outputs:
            group = self.live[out.request_id]
            for sample in out.outputs:  # the samples that moved this step (`index`: which of the group's)
                j, new = sample.index, list(sample.token_ids)
                group.token_ids[j] += new
                group.logprobs[j] += [float(sample.logprobs[i][tok].logprob) for i, tok in enumerate(new)] if new else []
                group.versions[j] += [self.version] * len(new)
                if sample.finish_reason is not None:
                    group.finished[j] = sample.finish_reason == "stop"
                    group.done += 1
                    self.running -= 1
                    if self.records is not None and group.key >= 0:
                        self.records.sample_finished(out.request_id, group, j)
            if group.done == group.n:
                if self.records is not None:
                    self.records.file()  # before it completes: the answer it may complete carries them
                del self.live[out.request_id]
                self._complete(group)

    def _complete(self, group: Group) -> None:
        if group.key < 0:  # an evaluation prompt
            self._finish_evaluation()
            return
        self.live_groups.discard(group.key)
        if not self.book.place(group, self.version, self.decode_steps):
            target = self.book.filling if self.opts.stream else group.step
            self.dropped[target] = self.dropped.get(target, 0) + 1  # counted in the batch it could not join
            self.keys += 1
            self.backlog.appendleft(group.again(self.keys))
        self._answer_take()

    def _answer_take(self) -> None:
        if self.take is None or not self.book.full(self.take[1]):
            return
        request_id, step = self.take
        self.take = None
        groups = [
            {"index": g.index, "token_ids": g.token_ids, "logprobs": g.logprobs, "versions": g.versions, "finished": g.finished,
             "routing": g.routing}
            for g in self.book.pop(step)
        ]
        result = {"groups": groups, "idle_s": self.idle_s, "busy_s": self.busy_s, "dropped": self.dropped.pop(step, 0)}
        self.idle_s = self.busy_s = 0.0
        self.outbox.send({"op": "reply", "id": request_id, "ok": True, "result": result})

    # --- evaluation: greedy or sampled requests among the training ones, answered when all are done

    def _start_evaluation(self) -> None:
        assert self.evaluation is not None
        s = self.evaluation["sampling"]
        self.evaluation["queue"] = deque(enumerate(self.evaluation["prompts"]))
        self.evaluation["groups"] = []
        self.evaluation["pending"] = 0
        self.evaluated.add(self.version)
        self.evaluation["n"] = int(s["n"])

    def _admit_evaluation(self) -> None:
        assert self.evaluation is not None
        ev, n = self.evaluation, self.evaluation["n"]
        queue: deque[tuple[int, list[int]]] = ev["queue"]
        count = admit_count(self.running, [len(p) for _, p in queue], n, self.max_num_seqs, self.token_budget)
        for _ in range(count):
            i, prompt = queue.popleft()
            group = Group(-1 - i, i, 0, i, [int(t) for t in prompt], request_seed(int(ev["sampling"]["seed"]), i, n), n)
            self._request(f"e{ev['id']}-{i}", group, ev["sampling"])
            ev["groups"].append(group)
            ev["pending"] += 1
        if not ev["prompts"]:
            self._finish_evaluation()

    def _finish_evaluation(self) -> None:
        ev = self.evaluation
        assert ev is not None
        if ev["queue"] or sum(g.done == g.n for g in ev["groups"]) < len(ev["prompts"]):
            return
        rows = [
            {"prompt_index": g.position, "token_ids": g.token_ids[j], "logprobs": g.logprobs[j], "finished": g.finished[j]}
            for g in sorted(ev["groups"], key=lambda g: g.position) for j in range(g.n)
        ]
        self.evaluation = None
        self.outbox.send({"op": "reply", "id": ev["id"], "ok": True, "result": rows})


def serve_stream(channel: ControlChannel, engine: VLLMRolloutEngine, receiver: WeightReceiver, request: dict[str, Any]) -> None:
    """Answer `stream_open`, then run the loop until the trainer closes it."""
    opts = StreamOptions(**request["options"])
    channel.send({"op": "reply", "id": request["id"], "ok": True})
    loop = StreamLoop(channel, engine, receiver, opts)
    try:
        loop.run()
    finally:
        loop.outbox.close()
