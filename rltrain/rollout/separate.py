"""The vLLM engine in its own process (`rollout=vllm rollout.process=separate`).

The engine's memory, threads and process-wide state stay out of the trainer, and the weight sync
crosses a real process boundary, as it does when the engine runs on other devices or hosts.
docs/internals/rollout.md describes the child, its JSON control channel and its bounded waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, cast

import torch

from rltrain.config.group_options import VLLMRolloutConfig
from rltrain.config.run_context import RunContext
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.control_wire import ControlChannel, completions_from_json
from rltrain.rollout.images import PromptImages, images_to_json
from rltrain.runtime.precision import resolve_precision
from rltrain.runtime.threads import thread_split
from rltrain.transport.sender import TransportError, WeightSender
from rltrain.transport.wire import Message, make_private_dir

# torch.distributed / elastic variables the child must not inherit (vLLM would read them).
_DIST_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class RolloutProcessError(RuntimeError):
    """The rollout process died, stalled past its timeout, or reported an error."""


def _config_dict(cfg: VLLMRolloutConfig) -> dict[str, Any]:
    """The rollout config (a dataclass, or the run's OmegaConf node) as plain JSON values."""
    if is_dataclass(cfg) and not isinstance(cfg, type):
        return asdict(cfg)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


class SeparateVLLMEngine:
    """`RolloutEngine` whose `VLLMRolloutEngine` lives in a child process (see the module doc)."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: VLLMRolloutConfig,
        seed: int = 0,
        *,
        dtype: str = "float32",
        num_threads: int | None = None,
        ping_timeout_s: float = 5.0,
    ) -> None:
        self.cfg = cfg
        self.timeout_s = cfg.timeout_s
        self.ping_timeout_s = ping_timeout_s
        self._lock = threading.Lock()  # one request in flight (a health-check ping may race a step)
        self._next_id = 0
        self._abandoned: set[int] = set()  # pings that timed out: their late replies are skipped
        # Requests posted and not waited for yet (`post`), and their replies read meanwhile (by a
        # later request's wait) until `reply` asks for them.
        self._posted: set[int] = set()
        self._early: dict[int, Message] = {}
        self.proc: subprocess.Popen | None = None
        self.channel: ControlChannel | None = None
        self.directory = make_private_dir(None, prefix="rlsep-")
        try:
            self.sender = WeightSender(cfg.bucket_mb << 20, cfg.timeout_s, base_dir=self.directory)
            self._start(model_dir, seed, dtype, num_threads or torch.get_num_threads())
        except BaseException:
            self.close(kill=True)
            raise

    # --- child lifecycle ------------------------------------------------------------------------

    def _start(self, model_dir: str | Path, seed: int, dtype: str, num_threads: int) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = {
            "model_dir": os.fspath(model_dir),
            "cfg": _config_dict(self.cfg),
            "seed": seed,
            "dtype": dtype,
            "weights_control_path": os.fspath(self.sender.control_path),
            "num_threads": num_threads,
            "control_fd": child_end.fileno(),
        }
        env = {
            k: v for k, v in os.environ.items() if k not in _DIST_ENV and not k.startswith("TORCHELASTIC_")
        }
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # as for the in-process engine (rollout registry)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rltrain.rollout.separate_child", json.dumps(spec)],
                pass_fds=(child_end.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child_end.close()  # the child holds its copy: its death is EOF on ours
        self.channel = ControlChannel(parent_end, "rollout process", self.cfg.start_timeout_s)
        ready = self._recv(0, "the rollout process to build its engine", expect="ready")
        self.channel.timeout_s = self.timeout_s
        self.pid = int(ready["pid"])
        # False for a CUDA engine at rollout.sleep_level=2: time sharing re-sends weights after a wake.
        self.weights_survive_sleep = bool(ready.get("weights_survive_sleep", True))

    def close(self, kill: bool = False) -> None:
        """Stop the child (politely, then by force), remove every socket and directory. Idempotent."""
        # A polite close waits for a health-check ping in flight (bounded); `kill` comes from a
        # failed request that already holds the lock. A request still in flight on another thread
        # past that (generating ahead: the engine's worker) would race a polite close: kill instead.
        locked = not kill and self._lock.acquire(timeout=self.ping_timeout_s + 5)
        try:
            self._close(kill or not locked)
        finally:
            if locked:
                self._lock.release()

    def _close(self, kill: bool) -> None:
        proc, channel = self.proc, self.channel
        self.proc, self.channel = None, None
        try:
            if channel is not None and proc is not None and proc.poll() is None and not kill:
                # A polite close is best effort: a child that does not answer is stopped below.
                with contextlib.suppress(OSError, TransportError):
                    channel.timeout_s = min(self.timeout_s, 30.0)
                    self._next_id += 1
                    channel.send({"op": "close", "id": self._next_id})
                    channel.recv("the rollout process to shut down")
            if proc is not None:
                try:
                    proc.wait(timeout=0 if kill else 30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
        finally:
            if channel is not None:
                channel.close()
            sender = getattr(self, "sender", None)
            if sender is not None:
                sender.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def __del__(self) -> None:  # a forgotten engine must not leave a child behind
        if getattr(self, "proc", None) is not None:
            with contextlib.suppress(Exception):  # at interpreter exit modules may already be gone
                self.close(kill=True)

    # --- request/reply --------------------------------------------------------------------------

    def _dead(self, what: str, cause: BaseException) -> RolloutProcessError:
        """The error for a child that is gone, or stalled (then it is killed): the engine is
        unusable either way, so it is closed and every later call fails at once."""
        proc = self.proc
        code: int | None = None
        stalled = isinstance(cause, TimeoutError)
        if proc is not None:
            try:
                code = proc.wait(timeout=0.1 if stalled else 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(timeout=30)
        self.close(kill=True)
        how = f"did not answer within {self.channel_timeout_s}s and was killed" if stalled else "exited"
        return RolloutProcessError(
            f"the rollout process (rollout.process=separate) failed {what}: it {how} (exit code {code}; "
            f"{cause}). Its own error, if any, is in the run's log above."
        )

    def _send(self, op: str, **fields: Any) -> int:
        if self.channel is None:
            raise RolloutProcessError(
                "the rollout process is closed (it failed earlier or close() was called)"
            )
        if self.proc is not None and self.proc.poll() is not None:  # gone between calls: say so, send nothing
            raise self._dead(f"before {op!r}", ChildProcessError(f"pid {self.proc.pid} is gone"))
        self._next_id += 1
        try:
            self.channel.send({"op": op, "id": self._next_id, **fields})
        except TransportError as exc:
            raise self._dead(f"before {op!r}", exc) from exc
        return self._next_id

    def _recv(self, request_id: int, what: str, expect: str = "reply") -> Message:
        assert self.channel is not None
        self.channel_timeout_s = self.channel.timeout_s
        try:
            message = self._early.pop(request_id, None) or self._next_message(what, request_id)
        except TransportError as exc:
            raise self._dead(f"while waiting for {what}", exc) from exc
        if message["op"] != expect or message["id"] != request_id:
            self.close(kill=True)
            raise RolloutProcessError(
                f"the rollout process answered {message['op']!r} #{message['id']} to {expect!r} #{request_id}"
            )
        if not message.get("ok", False):
            raise RolloutProcessError(
                f"the rollout process failed {what}:\n{message.get('error', '(no detail)')}"
            )
        return message

    def _next_message(self, what: str, request_id: int) -> Message:
        """The next message for `request_id` (or an unexpected one, which the caller refuses)."""
        assert self.channel is not None
        while True:
            message = self.channel.recv(what)
            if not self._set_aside(message, request_id):
                return message

    def _set_aside(self, message: Message, request_id: int) -> bool:
        """True for another request's reply, handled here: a late ping reply is skipped, a posted
        request's reply kept for its `reply` call."""
        if message["op"] != "reply" or message["id"] == request_id:
            return False
        if message["id"] in self._abandoned:
            self._abandoned.discard(message["id"])
            return True
        if message["id"] in self._posted:
            self._early[message["id"]] = message
            return True
        return False

    def _call(self, op: str, **fields: Any) -> Any:
        with self._lock:
            request_id = self._send(op, **fields)
            return self._recv(request_id, f"{op!r}").get("result")

    def request(self, op: str, **fields: Any) -> Any:
        """One request of the in-flight mode's ops (`stream_open`, `submit`, `take`:
        rltrain/rollout/inflight_child.py), answered like every other."""
        return self._call(op, **fields)

    def post(self, op: str, **fields: Any) -> int:
        """Send a request now and wait for its answer later (`reply`): the in-flight mode asks for
        the next batch before it trains on this one, so the child answers the moment the batch is
        complete instead of at its next look at the channel (a decoding step later). Other requests
        may go and come back meanwhile; this one's answer is kept for `reply`."""
        with self._lock:
            request_id = self._send(op, **fields)
            self._posted.add(request_id)
            return request_id

    def reply(self, request_id: int) -> Any:
        """The result of a posted request, waiting for it (bounded by `rollout.timeout_s`)."""
        with self._lock:
            try:
                return self._recv(request_id, "a posted request").get("result")
            finally:
                self._posted.discard(request_id)

    # --- RolloutEngine --------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, images: list[PromptImages] | None = None
    ) -> list[Completion]:
        """Images cross the JSON control channel as PNG data URLs (rollout/images.py), never pickled."""
        rows = self._call(
            "generate", prompts=[list(map(int, p)) for p in prompts], sampling=asdict(sampling), images=images_to_json(images)
        )
        return completions_from_json(rows)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The whole checkpoint through the bucketed transport; returns when the child has loaded
        it (vLLM's in-place reload, tied-head refresh, prefix-cache reset)."""
        with self._lock:
            # Shared memory first: a /dev/shm too small for the buckets fails here, with the size
            # needed and the fix, before the child is told a sync is coming (it stays usable).
            self.sender.allocate()
            request_id = self._send("update")
            try:
                self.sync_stats = self.sender.send(weights)
            except TransportError as exc:
                if self.proc is None or self.proc.poll() is not None:
                    raise self._dead("during a weight sync", exc) from exc
                # The child is alive and aborted (its reply says why); keep the channel in step.
                self._recv(request_id, "a weight sync")
                raise
            self._recv(request_id, "a weight sync")

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self) -> None:
        self._call("wake")

    def metrics(self) -> dict[str, float]:
        return {}

    def ping(self) -> bool:
        """A real round trip to the child (its engine answers a no-op on its worker), bounded by
        `ping_timeout_s`, that never harms a healthy engine: an unanswered ping is reported (an
        exception naming it) and abandoned, its late reply skipped, the child left running; a dead
        child is reported with its exit code, and the next training call fails as usual. While a
        training request is in flight (a generation, a sync) the child cannot answer; that request
        is bounded by `rollout.timeout_s`, so then the process's presence is the answer."""
        if not self._lock.acquire(timeout=self.ping_timeout_s):
            self._check_running()
            return True
        try:
            self._check_running()
            channel = self.channel
            assert channel is not None
            self._next_id += 1
            request_id = self._next_id
            try:
                channel.send({"op": "ping", "id": request_id})
                deadline = time.monotonic() + self.ping_timeout_s
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([channel.sock], [], [], left)[0]:
                        self._abandoned.add(request_id)
                        raise RolloutProcessError(
                            f"the rollout process (pid {self.pid}) did not answer a ping "
                            f"within {self.ping_timeout_s:g} s (left running)"
                        )
                    message = channel.recv("a ping")
                    if not self._set_aside(message, request_id):
                        break
            except TransportError as exc:
                if self.proc is not None:  # a dying child closes its socket a moment before it exits
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=min(1.0, self.ping_timeout_s))
                self._check_running()
                raise RolloutProcessError(f"the rollout process does not answer: {exc}") from exc
            if message["id"] != request_id or not message.get("ok", False):
                raise RolloutProcessError(
                    f"the rollout process failed a ping: {message.get('error', message)!s:.2000}"
                )
            return bool(message.get("result"))
        finally:
            self._lock.release()

    def _check_running(self) -> None:
        proc = self.proc
        if proc is None or self.channel is None:
            raise RolloutProcessError("the rollout process is closed (it failed earlier or close() was called)")
        code = proc.poll()
        if code is not None:
            raise RolloutProcessError(f"the rollout process (pid {proc.pid}) exited with code {code}")


def build_engine(ctx: RunContext) -> SeparateVLLMEngine:
    """The run's out-of-process vLLM engine (registry key `vllm` with `rollout.process=separate`)."""
    rollout = cast(VLLMRolloutConfig, ctx.cfg.rollout)  # the registry chose this module for rollout=vllm
    return SeparateVLLMEngine(
        ctx.model_dir,
        rollout,
        seed=rollout.seed,
        dtype=resolve_precision(ctx.cfg.trainer.precision, ctx.dist.device).compute_dtype_name,
        ping_timeout_s=ctx.cfg.health.ping_timeout_s,
        num_threads=thread_split(
            ctx.cfg.trainer.num_threads, rollout.num_threads, ctx.cfg.placement.max_staleness >= 1, ctx.dist.world_size
        )[1],
    )
