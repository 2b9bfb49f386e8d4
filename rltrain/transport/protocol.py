"""The weight transport's constants and the stats of one sync, in one place: both ends of the
transport (`sender.WeightSender`, `receiver.WeightReceiver`) and its layers (wire
framing, buckets, shared memory) read them from here, so no module of the transport imports
another to learn a number. docs/time-sharing-and-sync.md describes the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOL_VERSION = 1
NO_BUCKET = -1  # bucket_id of messages that are not about one bucket (hello, offer, ready)
NO_SYNC = -1  # sync_id of the receiver's hello: it does not know the next sync id yet

MAGIC = b"RLW1"  # 4 bytes that start every frame; a pickle stream starts with b"\x80"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a bucket of many tiny tensors has a long entry list
MESSAGE_TYPES = frozenset({"hello", "offer", "ready", "bucket", "ack", "end", "done", "abort"})

ALIGN_BYTES = 256  # every tensor in a bucket starts at a multiple of this

SEGMENT_PREFIX = "rltrain-w-"  # the brief name a segment has in /dev/shm while being created
SHM_DIR_ENV = "RLTRAIN_SHM_DIR"  # a directory on a tmpfs to use instead of /dev/shm (tests)


@dataclass(frozen=True)
class SyncStats:
    sync_id: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float
