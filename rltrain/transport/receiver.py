"""The receiving side of the weight transport (see sender.py for the protocol): the rollout
process asks for each sync's offer, maps the sender's shared-memory segments once and streams
tensors out bucket by bucket, checking every message's (sync id, bucket id) tag."""


from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rltrain.transport.buckets import BucketUnpacker
from rltrain.transport.protocol import ALIGN_BYTES, NO_BUCKET, NO_SYNC, PROTOCOL_VERSION, SyncStats
from rltrain.transport.shm import SharedSegment
from rltrain.transport.wire import (
    Channel,
    Message,
    PeerAborted,
    PeerClosed,
    ProtocolError,
    connect_unix,
)

log = logging.getLogger(__name__)


class WeightReceiver:
    """Rollout side. Built with the sender's `control_path` (passed to the child process at
    start); each `receive()` is one sync and yields `(name, tensor)` as buckets arrive, so the
    engine can stream them into `reload_weights(weights_iterator=...)`.

    timeout_s: bound on every single wait (the sender's offer, each bucket).
    """

    def __init__(self, control_path: str | os.PathLike[str], timeout_s: float = 120.0) -> None:
        self.control_path = os.fspath(control_path)
        self.timeout_s = timeout_s
        self.last_stats: SyncStats | None = None
        self._segments: dict[tuple[int, int], SharedSegment] = {}  # kept across syncs, by (dev, inode)

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the mappings kept between syncs (idempotent; the next sync maps afresh)."""
        for segment in self._segments.values():
            segment.close()
        self._segments = {}

    def receive(self, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """One sync, as an iterator. Exhaust it: the sync completes (and is acknowledged) only
        when the iterator ends; errors are raised from it, and abandoning it aborts the sync.

        copy=True: every yielded tensor is owned by the caller, and a bucket is acknowledged as
          soon as it is unpacked, so the sender packs the next one while the caller loads. vLLM's
          in-place `reload_weights` needs this: it buffers a layer's tensors until the layer is
          complete.
        copy=False: tensors that fit in a bucket are zero-copy views of shared memory, valid only
          until the next item is requested (copy them, e.g. `param.copy_(tensor)`, before that).
        """
        started = time.perf_counter()
        sync_id, bucket_id = NO_SYNC, NO_BUCKET
        data: Channel | None = None
        try:
            offer, fds = self._request_offer()
            sync_id, bucket_bytes = offer["sync_id"], offer["bucket_bytes"]
            segments = self._map_segments(fds, bucket_bytes)
            data = self._connect(offer["endpoint"])
            data.send({"type": "ready", "sync_id": sync_id, "bucket_id": NO_BUCKET})
            unpacker = BucketUnpacker(bucket_bytes)
            bucket_id = 0
            while True:
                message = data.recv(f"bucket {bucket_id} of sync {sync_id}")
                self._check_in_step(message, sync_id, bucket_id)
                if message["type"] == "end":
                    break
                segment = self._segment_of(message, segments, sync_id, bucket_id)
                completed = unpacker.unpack(message.get("entries"), segment.bytes_u8, copy)
                if copy:
                    data.send({"type": "ack", "sync_id": sync_id, "bucket_id": bucket_id})
                yield from completed
                del completed
                if not copy:
                    data.send({"type": "ack", "sync_id": sync_id, "bucket_id": bucket_id})
                bucket_id += 1
            self._check_end(message, unpacker, sync_id)
            data.send({"type": "done", "sync_id": sync_id, "bucket_id": bucket_id})
            self.last_stats = SyncStats(
                sync_id, unpacker.tensor_count, unpacker.total_bytes, bucket_id, time.perf_counter() - started
            )
        except GeneratorExit:
            if data is not None:
                data.abort(
                    sync_id, bucket_id, "the receiver stopped consuming weights before the end of the sync"
                )
            self.close()
            raise
        except BaseException as exc:
            if data is not None and not isinstance(exc, PeerAborted):
                data.abort(sync_id, bucket_id, f"{type(exc).__name__}: {exc}")
            self.close()  # the sender re-creates its segments after a failure: forget ours
            raise
        finally:
            if data is not None:
                data.close()

    def _connect(self, endpoint: str) -> Channel:
        """The sync's data connection to the sender's endpoint (named in its offer)."""
        return Channel(connect_unix(endpoint, self._deadline(), "the sync endpoint", retry=False), "sender", self.timeout_s)

    @staticmethod
    def _segment_of(message: Message, segments: list[SharedSegment], sync_id: int, bucket_id: int) -> SharedSegment:
        """The shared-memory segment a bucket message names by its slot."""
        slot = message.get("slot")
        if type(slot) is not int or not 0 <= slot < len(segments):
            raise ProtocolError(f"bucket {bucket_id} of sync {sync_id} names invalid slot {slot!r}")
        return segments[slot]

    @staticmethod
    def _check_end(message: Message, unpacker: BucketUnpacker, sync_id: int) -> None:
        """The sync's end message agrees with what arrived: every tensor complete, counts equal."""
        unpacker.check_complete(sync_id)
        if message.get("tensors") != unpacker.tensor_count or message.get("bytes") != unpacker.total_bytes:
            raise ProtocolError(
                f"sync {sync_id} ended with {unpacker.tensor_count} tensors / {unpacker.total_bytes} bytes "
                f"received, the sender sent {message.get('tensors')} / {message.get('bytes')}"
            )

    def receive_into(self, on_tensor: Callable[[str, torch.Tensor], Any], copy: bool = True) -> SyncStats:
        """One sync, calling `on_tensor(name, tensor)` for each tensor; returns its stats."""
        for name, tensor in self.receive(copy=copy):
            on_tensor(name, tensor)
        assert self.last_stats is not None
        return self.last_stats

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _request_offer(self) -> tuple[Message, list[int]]:
        """Say hello on the sender's control socket and wait for the offer. If the sender is
        re-creating its control socket after a failed sync, the connection is reset: retry until
        the deadline."""
        deadline = self._deadline()
        while True:
            conn = connect_unix(self.control_path, deadline, "the sender's control socket", retry=True)
            control = Channel(conn, "sender", max(deadline - time.monotonic(), 1e-3))
            try:
                control.send(
                    {
                        "type": "hello",
                        "sync_id": NO_SYNC,
                        "bucket_id": NO_BUCKET,
                        "protocol": PROTOCOL_VERSION,
                    }
                )
                offer = control.recv("an offer (WeightSender.send)")
                if offer["type"] != "offer" or offer["bucket_id"] != NO_BUCKET:
                    raise ProtocolError(f"expected an 'offer' from the sender, got {offer['type']!r}")
                self._check_offer(offer)
                return offer, control.recv_fds(offer["slots"], "the shared-memory segments")
            except PeerClosed:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)
            finally:
                control.close()

    @staticmethod
    def _check_offer(offer: Message) -> None:
        if offer.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"sender speaks protocol {offer.get('protocol')!r}, receiver speaks {PROTOCOL_VERSION}"
            )
        endpoint, bucket_bytes, slots = offer.get("endpoint"), offer.get("bucket_bytes"), offer.get("slots")
        if (
            not isinstance(endpoint, str)
            or not os.path.isabs(endpoint)
            or type(bucket_bytes) is not int
            or bucket_bytes < ALIGN_BYTES
            or type(slots) is not int
            or not 1 <= slots <= 16
        ):
            raise ProtocolError(f"malformed offer: {offer!r}")

    def _map_segments(self, fds: list[int], bucket_bytes: int) -> list[SharedSegment]:
        """Map the received descriptors, reusing the mapping of a segment seen in an earlier sync
        (same device and inode), so steady-state syncs fault in no pages. Owns `fds`."""
        mapped: dict[tuple[int, int], SharedSegment] = {}
        try:
            for index, fd in enumerate(fds):
                fds[index] = -1  # this loop owns `fd` now
                try:
                    info = os.fstat(fd)
                    identity = (info.st_dev, info.st_ino)
                    known = self._segments.get(identity)
                except BaseException:
                    os.close(fd)
                    raise
                if known is not None and known.nbytes == bucket_bytes:
                    os.close(fd)
                    mapped[identity] = known
                else:
                    mapped[identity] = SharedSegment.from_fd(fd, bucket_bytes)  # closes fd
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        if len(mapped) != len(fds):
            raise ProtocolError(
                f"the sender passed {len(fds)} descriptors for only {len(mapped)} distinct segments"
            )
        for identity, segment in self._segments.items():
            if identity not in mapped:
                segment.close()
        self._segments = mapped
        return list(mapped.values())

    @staticmethod
    def _check_in_step(message: Message, sync_id: int, bucket_id: int) -> None:
        """The next message must be bucket `bucket_id` (or the end, after it) of this sync."""
        kind, got_sync, got_bucket = message["type"], message["sync_id"], message["bucket_id"]
        if kind not in ("bucket", "end"):
            raise ProtocolError(f"expected bucket {bucket_id} of sync {sync_id}, got a {kind!r} message")
        if got_sync != sync_id:
            raise ProtocolError(f"expected a message of sync {sync_id}, got one of sync {got_sync}")
        if got_bucket < bucket_id:
            raise ProtocolError(
                f"sync {sync_id}: bucket {got_bucket} arrived again while bucket {bucket_id} "
                "was expected (a duplicated message)"
            )
        if got_bucket > bucket_id:
            what = "the end of the sync" if kind == "end" else f"bucket {got_bucket}"
            raise ProtocolError(
                f"sync {sync_id}: got {what} while bucket {bucket_id} was expected "
                f"(bucket {bucket_id} was lost or the messages were reordered)"
            )
