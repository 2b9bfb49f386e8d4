"""How named tensors are laid out in fixed-size buckets, and put back together.

`BucketPacker` (sender) and `BucketUnpacker` (receiver) keep alignment, chunking of oversized
tensors and bounds checks of the JSON metadata in one place, so that no dtype or size can corrupt
or half-update a weight. docs/internals/sync.md lists the rules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rltrain.transport.protocol import ALIGN_BYTES
from rltrain.transport.wire import ProtocolError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"weight transport does not support dtype {dtype}; supported: {sorted(DTYPES)}"
        ) from None


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class Entry:
    """One tensor, or one chunk of a tensor, inside a bucket. Travels as a JSON object."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset inside the bucket, a multiple of ALIGN_BYTES
    nbytes: int  # bytes of this entry (the whole tensor unless chunked)
    chunk_index: int = 0
    chunk_count: int = 1
    chunk_byte_offset: int = 0  # where this chunk's bytes go in the full tensor

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies every field, measurably slow for thousands of entries.
        return {field: getattr(self, field) for field in self.__dataclass_fields__} | {
            "shape": list(self.shape)
        }

    @property
    def total_nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @classmethod
    def from_json(cls, data: Any, bucket_bytes: int) -> Entry:
        """Parse and bounds-check one entry from the peer's metadata."""
        fields = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or set(data) != fields:
            raise ProtocolError(
                f"malformed bucket entry {data!r}: expected exactly the keys {sorted(fields)}"
            )
        ints = ("offset", "nbytes", "chunk_index", "chunk_count", "chunk_byte_offset")
        shape = data["shape"]
        if (
            not isinstance(data["name"], str)
            or data["dtype"] not in DTYPES
            or not isinstance(shape, list)
            or any(type(size) is not int or size < 0 for size in shape)
            or any(type(data[key]) is not int or data[key] < 0 for key in ints)
        ):
            raise ProtocolError(f"malformed bucket entry {data!r}")
        entry = cls(**{**data, "shape": tuple(shape)})
        where = f"entry {entry.name!r} (chunk {entry.chunk_index}/{entry.chunk_count})"
        if entry.offset % ALIGN_BYTES or entry.offset + entry.nbytes > bucket_bytes:
            raise ProtocolError(
                f"{where} at offset {entry.offset} + {entry.nbytes} bytes is misaligned or "
                f"outside the {bucket_bytes}-byte bucket"
            )
        if not entry.chunk_index < entry.chunk_count:
            raise ProtocolError(f"{where}: chunk index out of range")
        if entry.chunk_byte_offset + entry.nbytes > entry.total_nbytes:
            raise ProtocolError(
                f"{where}: bytes {entry.chunk_byte_offset}+{entry.nbytes} exceed the tensor's "
                f"{entry.total_nbytes} bytes"
            )
        if entry.chunk_count == 1 and entry.nbytes != entry.total_nbytes:
            raise ProtocolError(f"{where}: {entry.nbytes} bytes for a tensor of {entry.total_nbytes} bytes")
        return entry


@dataclass(frozen=True)
class PackedBucket:
    """A bucket whose bytes are already in `slot`; `entries` say where each tensor lies."""

    bucket_id: int
    slot: int
    entries: list[Entry]
    used_bytes: int


class BucketPacker:
    """Copies `(name, tensor)` pairs into shared-memory slots, one bucket at a time.

    Bucket `b` is written into slot `b % len(slots)`. `buckets()` is a generator that writes a
    bucket's bytes *while it is being advanced*: the caller must not advance it into a slot the
    receiver may still be reading (with two slots, strict request/reply guarantees that).
    Tensors that fit in a bucket are never split; a tensor larger than a bucket starts in the
    free tail of the current bucket and continues in whole buckets.
    """

    def __init__(self, slots_u8: Sequence[torch.Tensor], bucket_bytes: int) -> None:
        if bucket_bytes < ALIGN_BYTES or bucket_bytes % ALIGN_BYTES:
            raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN_BYTES}, got {bucket_bytes}")
        self.slots_u8 = slots_u8
        self.bucket_bytes = bucket_bytes
        self.tensor_count = 0
        self.total_bytes = 0

    def buckets(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[PackedBucket]:
        bucket_id, cursor = 0, 0
        entries: list[Entry] = []
        for name, tensor in weights:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"weights must yield (str, torch.Tensor) pairs, got ({type(name)}, {type(tensor)})"
                )
            dtype = dtype_name(tensor.dtype)
            shape = tuple(tensor.shape)
            nbytes = tensor_nbytes(tensor)
            self.tensor_count += 1
            self.total_bytes += nbytes
            if nbytes <= self.bucket_bytes:
                if align_up(cursor) + nbytes > self.bucket_bytes:
                    yield PackedBucket(bucket_id, bucket_id % len(self.slots_u8), entries, cursor)
                    bucket_id, cursor, entries = bucket_id + 1, 0, []
                offset = align_up(cursor)
                slot_u8 = self.slots_u8[bucket_id % len(self.slots_u8)]
                slot_u8[offset : offset + nbytes].view(tensor.dtype).view(shape).copy_(tensor.detach())
                entries.append(Entry(name, dtype, shape, offset, nbytes))
                cursor = offset + nbytes
                continue
            # Larger than a bucket: byte chunks, the first one in the current bucket's free tail.
            if align_up(cursor) >= self.bucket_bytes:
                yield PackedBucket(bucket_id, bucket_id % len(self.slots_u8), entries, cursor)
                bucket_id, cursor, entries = bucket_id + 1, 0, []
            first_chunk_bytes = self.bucket_bytes - align_up(cursor)
            chunk_count = 1 + math.ceil((nbytes - first_chunk_bytes) / self.bucket_bytes)
            source_u8 = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            done_bytes = 0
            for chunk_index in range(chunk_count):
                if chunk_index > 0:
                    yield PackedBucket(bucket_id, bucket_id % len(self.slots_u8), entries, cursor)
                    bucket_id, cursor, entries = bucket_id + 1, 0, []
                offset = align_up(cursor)
                chunk_bytes = min(self.bucket_bytes - offset, nbytes - done_bytes)
                slot_u8 = self.slots_u8[bucket_id % len(self.slots_u8)]
                slot_u8[offset : offset + chunk_bytes].copy_(source_u8[done_bytes : done_bytes + chunk_bytes])
                entries.append(
                    Entry(name, dtype, shape, offset, chunk_bytes, chunk_index, chunk_count, done_bytes)
                )
                cursor = offset + chunk_bytes
                done_bytes += chunk_bytes
        if entries:
            yield PackedBucket(bucket_id, bucket_id % len(self.slots_u8), entries, cursor)


@dataclass
class _PartialTensor:
    tensor: torch.Tensor
    bytes_u8: torch.Tensor  # flat byte view of `tensor`
    next_chunk: int
    chunk_count: int
    received_bytes: int


class BucketUnpacker:
    """Receiver side: turns validated bucket entries back into tensors, reassembling chunks.

    `unpack(entries, bucket_u8, copy)` returns the tensors completed by this bucket. With
    `copy=False` single-entry tensors are views into the shared bucket, valid only until the
    bucket is acknowledged; chunked tensors are always freshly allocated.
    """

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.partial: dict[str, _PartialTensor] = {}
        self.tensor_count = 0
        self.total_bytes = 0

    def unpack(self, raw_entries: Any, bucket_u8: torch.Tensor, copy: bool) -> list[tuple[str, torch.Tensor]]:
        if not isinstance(raw_entries, list):
            raise ProtocolError(f"bucket entries must be a JSON list, got {type(raw_entries).__name__}")
        completed = []
        for raw in raw_entries:
            entry = Entry.from_json(raw, self.bucket_bytes)
            source_u8 = bucket_u8[entry.offset : entry.offset + entry.nbytes]
            self.total_bytes += entry.nbytes
            if entry.chunk_count == 1:
                if entry.name in self.partial:
                    raise ProtocolError(
                        f"tensor {entry.name!r} restarted while its chunks were still arriving"
                    )
                tensor = source_u8.view(DTYPES[entry.dtype]).view(entry.shape)
                completed.append((entry.name, tensor.clone() if copy else tensor))
                continue
            partial = self._partial_for(entry)
            partial.bytes_u8[entry.chunk_byte_offset : entry.chunk_byte_offset + entry.nbytes].copy_(
                source_u8
            )
            partial.next_chunk += 1
            partial.received_bytes += entry.nbytes
            if partial.next_chunk == partial.chunk_count:
                del self.partial[entry.name]
                if partial.received_bytes != entry.total_nbytes:
                    raise ProtocolError(
                        f"tensor {entry.name!r}: its chunks hold {partial.received_bytes} bytes, "
                        f"expected {entry.total_nbytes}"
                    )
                completed.append((entry.name, partial.tensor))
        self.tensor_count += len(completed)
        return completed

    def _partial_for(self, entry: Entry) -> _PartialTensor:
        partial = self.partial.get(entry.name)
        if partial is None:
            if entry.chunk_index != 0:
                raise ProtocolError(
                    f"tensor {entry.name!r}: chunk {entry.chunk_index} of {entry.chunk_count} "
                    "arrived before chunk 0 (a bucket was lost or reordered)"
                )
            tensor = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
            partial = _PartialTensor(tensor, tensor.reshape(-1).view(torch.uint8), 0, entry.chunk_count, 0)
            self.partial[entry.name] = partial
        if entry.chunk_index != partial.next_chunk or entry.chunk_count != partial.chunk_count:
            raise ProtocolError(
                f"tensor {entry.name!r}: got chunk {entry.chunk_index} of {entry.chunk_count}, "
                f"expected chunk {partial.next_chunk} of {partial.chunk_count}"
            )
        if entry.chunk_byte_offset != partial.received_bytes:
            raise ProtocolError(
                f"tensor {entry.name!r}: chunk {entry.chunk_index} starts at byte "
                f"{entry.chunk_byte_offset}, expected {partial.received_bytes}"
            )
        return partial

    def check_complete(self, sync_id: int) -> None:
        """At the end of a sync: every chunked tensor must have all its chunks."""
        if self.partial:
            missing = ", ".join(
                f"{name!r} has {p.next_chunk} of {p.chunk_count} chunks"
                for name, p in sorted(self.partial.items())
            )
            raise ProtocolError(f"sync {sync_id} ended with incomplete tensors: {missing}")
