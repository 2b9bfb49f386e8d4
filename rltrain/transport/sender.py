"""Out-of-process weight transport: trainer (`WeightSender`) to rollout process (`WeightReceiver`).

A rollout engine in another process needs the new weights every step without a second copy of the
model in flight: tensors stream through fixed-size shared-memory buckets, with JSON metadata on a
Unix socket, straight into the engine's in-place reload.
docs/internals/sync.md has the usage, the protocol of one sync and the lifetimes of its sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from rltrain.transport.buckets import BucketPacker, PackedBucket
from rltrain.transport.protocol import ALIGN_BYTES, NO_BUCKET, NO_SYNC, PROTOCOL_VERSION, SyncStats
from rltrain.transport.shm import SharedMemoryFull, SharedSegment, shm_full_error
from rltrain.transport.wire import (
    Channel,
    Message,
    PeerAborted,
    PeerClosed,
    ProtocolError,
    TransportError,
    TransportTimeout,
    accept_until,
    expect,
    listen_unix,
    make_private_dir,
)

__all__ = [
    "ALIGN_BYTES",
    "FaultHook",
    "PeerAborted",
    "PeerClosed",
    "ProtocolError",
    "SyncStats",
    "TransportError",
    "TransportTimeout",
    "WeightSender",
]

log = logging.getLogger(__name__)

# Test-only: sees every data-plane message the sender is about to send and returns the messages to
# send instead ([] drops it, [m, m] duplicates it, holding it back and returning it later reorders).
FaultHook = Callable[[Message], list[Message]]


class _SyncEndpoint:
    """The sender's per-sync rendezvous: a fresh private directory holding the data socket.
    `close()` removes both and is idempotent; it runs as soon as the receiver has connected."""

    def __init__(self, base_dir: Path | None, sync_id: int) -> None:
        self.directory = make_private_dir(base_dir, prefix=f"rlw-{sync_id}-")
        self.socket_path = self.directory / "s"
        try:
            self.listener: socket.socket | None = listen_unix(self.socket_path, backlog=1)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def accepting(self) -> socket.socket:
        if self.listener is None:
            raise TransportError(f"the data socket of sync endpoint {self.socket_path} is closed")
        return self.listener

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        shutil.rmtree(self.directory, ignore_errors=True)


class WeightSender:
    """Trainer side. Owns the control socket (`control_path`, in a private 0700 directory) that a
    `WeightReceiver` in the rollout process connects to; `send()` performs one sync.

    bucket_bytes: size of one shared-memory bucket (a multiple of 256). `num_slots` buckets
      (default 2, for double buffering) are held from the first sync until `close()`. On CPU,
      16 MiB pipelines well (see scripts/bench_sync.py); bigger buckets mean fewer, longer steps
      that overlap less.
    timeout_s: bound on every single wait (the receiver arriving, each reply).
    base_dir: where private directories go (default: the system temp dir). Unix socket paths
      are limited to ~104 bytes, so keep it short.
    fault_hook: fault injection for the tests and `make fault-suite` (scripts/fault_suite.py), see `FaultHook`.
    """

    def __init__(
        self,
        bucket_bytes: int = 16 << 20,
        timeout_s: float = 120.0,
        base_dir: str | os.PathLike[str] | None = None,
        num_slots: int = 2,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if bucket_bytes < ALIGN_BYTES or bucket_bytes % ALIGN_BYTES:
            raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN_BYTES}, got {bucket_bytes}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.num_slots = num_slots
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.fault_hook = fault_hook
        self.last_sync_id = 0
        self.control_dir = make_private_dir(self.base_dir, prefix="rlc-")
        self.control_path = self.control_dir / "c"
        self._control: socket.socket | None = listen_unix(self.control_path)
        self._segments: list[SharedSegment] = []  # created on first use, re-created after a failure

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the control socket and its directory; release the shared memory."""
        if self._control is not None:
            self._control.close()
            self._control = None
        shutil.rmtree(self.control_dir, ignore_errors=True)
        self._drop_segments()

    def _drop_segments(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []

    def allocate(self) -> None:
        """Create the buckets' shared memory if it is not there yet (`send` does it too). Raises
        SharedMemoryFull, naming the size needed, when /dev/shm cannot hold them; call it before
        telling a peer a sync is coming, so the error leaves the peer undisturbed."""
        if self._segments:
            return
        segments: list[SharedSegment] = []
        try:
            for _ in range(self.num_slots):
                segments.append(SharedSegment.create(self.bucket_bytes))
        except SharedMemoryFull as exc:
            for segment in segments:
                segment.close()
            raise shm_full_error(self.bucket_bytes * self.num_slots, f"{self.num_slots} buckets of "
                                 f"{self.bucket_bytes / 2**20:.0f} MiB") from exc
        except BaseException:
            for segment in segments:
                segment.close()
            raise
        self._segments = segments

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """One sync: waits for the receiver, streams every tensor, returns when the receiver has
        confirmed all of them. Raises TransportError (after telling the receiver to abort) on any
        failure; the next call starts from fresh sockets and segments."""
        if self._control is None:
            raise TransportError("this WeightSender is closed")
        self.last_sync_id += 1
        sync_id = self.last_sync_id
        started = time.perf_counter()
        self.allocate()
        endpoint = _SyncEndpoint(self.base_dir, sync_id)
        control: Channel | None = None
        data: Channel | None = None
        bucket_id = NO_BUCKET
        try:
            control = self._await_receiver(sync_id, endpoint)
            data = Channel(
                accept_until(endpoint.accepting(), self._deadline(), "the receiver on the data socket"),
                "receiver",
                self.timeout_s,
            )
            control.close()
            control = None
            endpoint.close()
            expect(data.recv("'ready'"), "ready", sync_id, NO_BUCKET, "receiver")
            packer = BucketPacker([segment.bytes_u8 for segment in self._segments], self.bucket_bytes)
            bucket_count = self._stream_buckets(data, sync_id, packer.buckets(weights))
            bucket_id = bucket_count
            end = {"type": "end", "sync_id": sync_id, "bucket_id": bucket_count,
                   "tensors": packer.tensor_count, "bytes": packer.total_bytes}
            self._exchange(data, end, reply="done", require_reply=True)
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            for channel in (data, control):
                if channel is not None and not isinstance(exc, PeerAborted):
                    channel.abort(sync_id, bucket_id, reason)
            self._recreate_control()
            self._drop_segments()  # a receiver that outlived the sync must not see the next one's bytes
            raise
        finally:
            for channel in (data, control):
                if channel is not None:
                    channel.close()
            endpoint.close()
        stats = SyncStats(
            sync_id, packer.tensor_count, packer.total_bytes, bucket_count, time.perf_counter() - started
        )
        log.debug("weight sync %d: %d tensors, %.1f MB, %d buckets, %.3fs",
                  sync_id, stats.tensors, stats.bytes / 1e6, stats.buckets, stats.seconds)
        return stats

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _await_receiver(self, sync_id: int, endpoint: _SyncEndpoint) -> Channel:
        """Accept the receiver's hello on the control socket and answer with this sync's offer.
        A connection left in the backlog by a receiver that already gave up is skipped."""
        deadline = self._deadline()
        while True:
            if self._control is None:
                raise TransportError("this WeightSender is closed")
            conn = accept_until(
                self._control, deadline, "the receiver to start a sync (WeightReceiver.receive)"
            )
            channel = Channel(conn, "receiver", max(deadline - time.monotonic(), 1e-3))
            try:
                hello = channel.recv("'hello'")
                expect(hello, "hello", NO_SYNC, NO_BUCKET, "receiver")
                if hello.get("protocol") != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"receiver speaks protocol {hello.get('protocol')!r}, "
                        f"sender speaks {PROTOCOL_VERSION}"
                    )
                channel.send(
                    {
                        "type": "offer",
                        "sync_id": sync_id,
                        "bucket_id": NO_BUCKET,
                        "protocol": PROTOCOL_VERSION,
                        "endpoint": os.fspath(endpoint.socket_path),
                        "bucket_bytes": self.bucket_bytes,
                        "slots": len(self._segments),
                    }
                )
                channel.send_fds([segment.sender_fd for segment in self._segments])
            except PeerClosed:
                channel.close()  # a stale connection from an earlier, abandoned receive()
                continue
            except BaseException:
                channel.close()
                raise
            channel.timeout_s = self.timeout_s
            return channel

    def _stream_buckets(self, data: Channel, sync_id: int, buckets: Iterator[PackedBucket]) -> int:
        """Send every bucket and collect its ack, never with two requests outstanding. With one
        slot the next bucket is packed only after the ack; with more, while the receiver works."""
        outstanding: Message | None = None
        count = 0
        while True:
            if outstanding is not None and self.num_slots == 1:
                self._finish(data, outstanding, reply="ack")
                outstanding = None
            bucket = next(buckets, None)  # packs the next bucket into its slot
            if outstanding is not None:
                self._finish(data, outstanding, reply="ack")
                outstanding = None
            if bucket is None:
                return count
            count += 1
            message = {
                "type": "bucket",
                "sync_id": sync_id,
                "bucket_id": bucket.bucket_id,
                "slot": bucket.slot,
                "used_bytes": bucket.used_bytes,
                "entries": [entry.to_json() for entry in bucket.entries],
            }
            outstanding = self._exchange(data, message, reply="ack", require_reply=False)

    def _exchange(self, data: Channel, message: Message, reply: str, require_reply: bool) -> Message | None:
        """Send `message` (through the fault hook, if any) and wait for the reply to every message
        that actually went out except the last, which is returned for the caller to finish."""
        outgoing = self.fault_hook(message) if self.fault_hook is not None else [message]
        last = None
        for sent in outgoing:
            if last is not None:
                self._finish(data, last, reply)
            data.send(sent)
            last = sent
        if require_reply:
            # A hook may have swallowed the request; the reply to the real one is still owed.
            self._finish(data, last if last is not None else message, reply)
            return None
        return last

    def _finish(self, data: Channel, request: Message, reply: str) -> None:
        what = f"{reply!r} for sync {request['sync_id']} bucket {request['bucket_id']}"
        expect(data.recv(what), reply, request["sync_id"], request["bucket_id"], "receiver")

    def _recreate_control(self) -> None:
        """Drop the control listener (and any connection queued on it) and bind a new one at the
        same path, so nothing from the failed sync reaches the next one."""
        if self._control is None:
            return
        self._control.close()
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()
        self._control = listen_unix(self.control_path)

