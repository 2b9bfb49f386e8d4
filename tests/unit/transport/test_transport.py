"""The out-of-process weight transport (rltrain.transport.sender): correctness, faults, cleanup.

Sender and receiver run in two threads (one spawned process for the killed-receiver case); every
test joins them under a short deadline, so a hang fails the test instead of stalling the suite.
After every test no shared-memory segment of this process and no file under the test's private
base directory may remain.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pathlib
import pickle
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rltrain.transport.buckets import BucketPacker, Entry
from rltrain.transport.protocol import ALIGN_BYTES, MAGIC, SEGMENT_PREFIX
from rltrain.transport.receiver import WeightReceiver
from rltrain.transport.sender import (
    PeerAborted,
    PeerClosed,
    ProtocolError,
    TransportTimeout,
    WeightSender,
)
from rltrain.transport.wire import listen_unix, make_private_dir

Weights = list[tuple[str, torch.Tensor]]
HANG_DEADLINE_S = 30.0


# ----------------------------------------------------------------------------- helpers


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


def run_sides(send: Callable[[], Any], receive: Callable[[], Any], deadline_s: float = HANG_DEADLINE_S):
    """Run both sides in threads; fail (instead of hanging) if either is still running at the deadline."""
    outcomes = (Outcome(), Outcome())

    def run(outcome: Outcome, fn: Callable[[], Any]) -> None:
        started = time.monotonic()
        try:
            outcome.value = fn()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcome.error = exc
        outcome.seconds = time.monotonic() - started

    threads = [
        threading.Thread(target=run, args=args, daemon=True) for args in zip(outcomes, (send, receive))
    ]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(max(end - time.monotonic(), 0.0))
    if any(thread.is_alive() for thread in threads):
        pytest.fail(f"weight sync still running after {deadline_s}s: a hang")
    return outcomes


def receive_all(receiver: WeightReceiver, copy: bool = True) -> Weights:
    # With copy=False the tensors are views valid until the next item: the consumer copies them.
    return [(name, tensor if copy else tensor.clone()) for name, tensor in receiver.receive(copy=copy)]


def sync(sender: WeightSender, receiver: WeightReceiver, weights: Weights, copy: bool = True):
    sent, received = run_sides(lambda: sender.send(iter(weights)), lambda: receive_all(receiver, copy))
    if sent.error or received.error:
        raise AssertionError(f"sync failed: sender {sent.error!r}, receiver {received.error!r}")
    return sent.value, received.value


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(got: Weights, expected: Weights) -> None:
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, tensor), (_, reference) in zip(got, expected):
        assert tensor.dtype == reference.dtype and tensor.shape == reference.shape, name
        assert torch.equal(as_bytes(tensor), as_bytes(reference)), name


def mixed_weights() -> Weights:
    generator = torch.Generator().manual_seed(0)
    nan_payload = (
        torch.tensor([0x7FC00001, 0xFFC12345], dtype=torch.int64).to(torch.int32).view(torch.float32)
    )
    return [
        ("embed.weight", torch.randn(64, 32, generator=generator)),
        ("layer.q_proj.weight", torch.randn(32, 32, generator=generator).to(torch.bfloat16)),
        ("layer.k_proj.weight", torch.randn(16, 32, generator=generator).to(torch.float16)),
        ("layer.scale", torch.randn((), generator=generator)),
        ("layer.transposed", torch.randn(8, 24, generator=generator).t()),  # not contiguous
        ("layer.nan_bits", nan_payload),
        ("position_ids", torch.arange(37, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("int8", torch.randint(-128, 127, (19,), dtype=torch.int8, generator=generator)),
        ("double", torch.randn(5, generator=generator, dtype=torch.float64)),
    ]


def own_segments() -> list[str]:
    return sorted(
        name for name in os.listdir("/dev/shm") if name.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")
    )


class Recorder:
    """A fault hook that changes nothing and remembers every message the sender sent."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    def __call__(self, message: dict) -> list[dict]:
        self.messages.append(message)
        return [message]


@pytest.fixture
def base_dir() -> Iterator[pathlib.Path]:
    """A short private directory for sockets; must be empty, and /dev/shm free of our segments,
    when the test ends (every sender is closed by then)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="rlt-"))
    try:
        yield path
        assert own_segments() == []
        assert list(path.iterdir()) == []
    finally:
        shutil.rmtree(path, ignore_errors=True)


def assert_only_control_socket(sender: WeightSender, base_dir: pathlib.Path) -> None:
    assert list(base_dir.iterdir()) == [sender.control_dir]
    assert os.listdir(sender.control_dir) == [sender.control_path.name]
    assert own_segments() == []


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("num_slots", [1, 2], ids=["one_slot", "two_slots"])
@pytest.mark.parametrize("copy", [True, False], ids=["copy", "zero_copy"])
def test_mixed_dtypes_round_trip_bitwise(base_dir: pathlib.Path, copy: bool, num_slots: int) -> None:
    weights = mixed_weights()
    with WeightSender(bucket_bytes=4096, timeout_s=5, base_dir=base_dir, num_slots=num_slots) as sender:
        receiver = WeightReceiver(sender.control_path, timeout_s=5)
        stats, received = sync(sender, receiver, weights, copy=copy)
        assert_bitwise_equal(received, weights)
        assert stats.tensors == len(weights) and stats.buckets > 1
        assert receiver.last_stats is not None and receiver.last_stats.bytes == stats.bytes
        assert_only_control_socket(sender, base_dir)


def test_tensor_2_5x_larger_than_bucket_is_chunked_and_reassembled(base_dir: pathlib.Path) -> None:
    bucket_bytes = 4096
    weights = [
        ("small", torch.randn(10)),
        ("big", torch.randn(int(2.5 * bucket_bytes) // 4)),  # 2.5 buckets of fp32
        ("big_bf16", torch.randn(3 * bucket_bytes // 2 + 7).to(torch.bfloat16)),  # odd element count
        ("after", torch.randn(3)),
    ]
    recorder = Recorder()
    with WeightSender(
        bucket_bytes=bucket_bytes, timeout_s=5, base_dir=base_dir, fault_hook=recorder
    ) as sender:
        _, received = sync(sender, WeightReceiver(sender.control_path, timeout_s=5), weights)
    assert_bitwise_equal(received, weights)
    chunks = [
        e for m in recorder.messages if m["type"] == "bucket" for e in m["entries"] if e["name"] == "big"
    ]
    assert [c["chunk_index"] for c in chunks] == list(range(chunks[0]["chunk_count"]))
    assert chunks[0]["chunk_count"] >= 3 and sum(c["nbytes"] for c in chunks) == int(2.5 * bucket_bytes)


def test_zero_size_and_bool_before_fp32_stay_aligned(base_dir: pathlib.Path) -> None:
    weights = [
        ("mask", torch.tensor([True, False, True])),
        ("weight", torch.randn(7)),
        ("empty", torch.zeros(0, 8)),
        ("empty_bf16", torch.zeros(0, dtype=torch.bfloat16)),
        ("bias", torch.randn(5).to(torch.float16)),
    ]
    recorder = Recorder()
    with WeightSender(bucket_bytes=1024, timeout_s=5, base_dir=base_dir, fault_hook=recorder) as sender:
        _, received = sync(sender, WeightReceiver(sender.control_path, timeout_s=5), weights)
    assert_bitwise_equal(received, weights)
    entries = [e for m in recorder.messages if m["type"] == "bucket" for e in m["entries"]]
    assert all(e["offset"] % ALIGN_BYTES == 0 for e in entries)
    assert {e["name"]: e["offset"] for e in entries}["weight"] == ALIGN_BYTES  # right after the 3-byte mask


def test_many_syncs_through_one_pair_and_callback_api(base_dir: pathlib.Path) -> None:
    with WeightSender(bucket_bytes=2048, timeout_s=5, base_dir=base_dir) as sender:
        receiver = WeightReceiver(sender.control_path, timeout_s=5)
        for step in range(3):
            weights = [("w", torch.full((100,), float(step))), ("b", torch.arange(step + 1))]
            got: Weights = []
            sent, received = run_sides(
                lambda w=weights: sender.send(w),
                lambda got=got: receiver.receive_into(lambda n, t: got.append((n, t))),
            )
            assert sent.error is None and received.error is None
            assert sent.value.sync_id == received.value.sync_id == step + 1
            assert_bitwise_equal(got, weights)


def test_shared_memory_is_nameless_during_a_sync_and_reused_across_syncs(base_dir: pathlib.Path) -> None:
    """Segments are unlinked at creation (so even a SIGKILLed sender leaves nothing in /dev/shm)
    and passed as descriptors; both sides keep them between syncs and renew them after a failure."""
    names_seen_during_sync: list[list[str]] = []

    def look_at_dev_shm(message: dict) -> list[dict]:
        names_seen_during_sync.append(own_segments())
        return [message]

    weights = [(f"w{i}", torch.randn(300)) for i in range(4)]
    with (
        WeightSender(bucket_bytes=2048, timeout_s=5, base_dir=base_dir, fault_hook=look_at_dev_shm) as sender,
        WeightReceiver(sender.control_path, timeout_s=5) as receiver,
    ):
        sync(sender, receiver, weights)
        first_mappings = set(receiver._segments)
        sync(sender, receiver, weights)
        assert set(receiver._segments) == first_mappings and len(first_mappings) == sender.num_slots
        assert names_seen_during_sync and all(names == [] for names in names_seen_during_sync)

        sender.fault_hook = drop_bucket_1
        sent, _ = run_sides(lambda: sender.send(weights), lambda: receive_all(receiver))
        assert isinstance(sent.error, PeerAborted)
        sender.fault_hook = None
        assert_bitwise_equal(sync(sender, receiver, weights)[1], weights)
        assert not set(receiver._segments) & first_mappings, "segments must be renewed after a failed sync"


def test_two_syncs_at_once_do_not_collide(base_dir: pathlib.Path) -> None:
    with (
        WeightSender(bucket_bytes=2048, timeout_s=10, base_dir=base_dir) as sender_a,
        WeightSender(bucket_bytes=1024, timeout_s=10, base_dir=base_dir) as sender_b,
    ):
        assert sender_a.control_path != sender_b.control_path
        weights_a = [(f"a{i}", torch.randn(300)) for i in range(8)]
        weights_b = [(f"b{i}", torch.randint(0, 9, (200,))) for i in range(8)]
        results: dict[str, tuple[Outcome, Outcome]] = {}

        def pair(key: str, sender: WeightSender, weights: Weights) -> None:
            receiver = WeightReceiver(sender.control_path, timeout_s=10)
            results[key] = run_sides(lambda: sender.send(weights), lambda: receive_all(receiver))

        threads = [
            threading.Thread(target=pair, args=("a", sender_a, weights_a)),
            threading.Thread(target=pair, args=("b", sender_b, weights_b)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_DEADLINE_S + 5)
        for key, weights in (("a", weights_a), ("b", weights_b)):
            sent, received = results[key]
            assert sent.error is None and received.error is None, (sent.error, received.error)
            assert_bitwise_equal(received.value, weights)


# ----------------------------------------------------------------------------- faults


def drop_bucket_1(message: dict) -> list[dict]:
    return [] if message["bucket_id"] == 1 and message["type"] == "bucket" else [message]


def duplicate_bucket_1(message: dict) -> list[dict]:
    return [message, message] if message["bucket_id"] == 1 and message["type"] == "bucket" else [message]


class ReorderBuckets1And2:
    def __init__(self) -> None:
        self.held: dict | None = None

    def __call__(self, message: dict) -> list[dict]:
        if message["type"] == "bucket" and message["bucket_id"] == 1:
            self.held = message
            return []
        if message["type"] == "bucket" and message["bucket_id"] == 2:
            return [message, self.held]
        return [message]


@pytest.mark.parametrize(
    ("hook", "receiver_error"),
    [
        (drop_bucket_1, "bucket 1 was lost or the messages were reordered"),
        (duplicate_bucket_1, "bucket 1 arrived again while bucket 2 was expected"),
        (ReorderBuckets1And2(), "got bucket 2 while bucket 1 was expected"),
    ],
    ids=["dropped", "duplicated", "reordered"],
)
def test_lost_duplicated_reordered_message_fails_fast_then_next_sync_works(
    base_dir: pathlib.Path, hook: Callable, receiver_error: str
) -> None:
    weights = [(f"w{i}", torch.randn(200)) for i in range(6)]  # 800 B each: one per 1 KiB bucket
    with WeightSender(bucket_bytes=1024, timeout_s=10, base_dir=base_dir, fault_hook=hook) as sender:
        receiver = WeightReceiver(sender.control_path, timeout_s=10)
        sent, received = run_sides(lambda: sender.send(weights), lambda: receive_all(receiver))
        assert isinstance(received.error, ProtocolError) and receiver_error in str(received.error)
        assert isinstance(sent.error, PeerAborted) and receiver_error in str(sent.error)
        assert max(sent.seconds, received.seconds) < 5, (
            "an out-of-step message must fail fast, not at the timeout"
        )
        assert_only_control_socket(sender, base_dir)
        sender.fault_hook = None
        _, again = sync(sender, receiver, weights)
        assert_bitwise_equal(again, weights)


def test_dropped_end_message_times_out_instead_of_hanging(base_dir: pathlib.Path) -> None:
    with WeightSender(
        bucket_bytes=1024,
        timeout_s=1.0,
        base_dir=base_dir,
        fault_hook=lambda m: [] if m["type"] == "end" else [m],
    ) as sender:
        receiver = WeightReceiver(sender.control_path, timeout_s=1.0)
        sent, received = run_sides(
            lambda: sender.send([("w", torch.randn(10))]), lambda: receive_all(receiver)
        )
        assert isinstance(received.error, TransportTimeout), received.error
        assert isinstance(sent.error, TransportTimeout | PeerAborted), sent.error
        assert "timed out" in str(sent.error)
        assert max(sent.seconds, received.seconds) < 4
        assert_only_control_socket(sender, base_dir)


def test_missing_chunk_at_end_of_sync_raises(base_dir: pathlib.Path) -> None:
    def drop_last_chunk(message: dict) -> list[dict]:
        if message["type"] == "bucket":
            message = {
                **message,
                "entries": [
                    e
                    for e in message["entries"]
                    if e["chunk_index"] + 1 < e["chunk_count"] or e["chunk_count"] == 1
                ],
            }
        return [message]

    with WeightSender(
        bucket_bytes=1024, timeout_s=5, base_dir=base_dir, fault_hook=drop_last_chunk
    ) as sender:
        receiver = WeightReceiver(sender.control_path, timeout_s=5)
        sent, received = run_sides(
            lambda: sender.send([("big", torch.randn(600))]), lambda: receive_all(receiver)
        )
    assert isinstance(received.error, ProtocolError)
    assert "incomplete tensors: 'big' has 2 of 3 chunks" in str(received.error)
    assert isinstance(sent.error, PeerAborted)


def test_sender_iterator_error_aborts_receiver_and_next_sync_works(base_dir: pathlib.Path) -> None:
    def failing_export() -> Iterator[tuple[str, torch.Tensor]]:
        yield "w0", torch.randn(300)
        yield "w1", torch.randn(300)
        raise ValueError("all-gather failed on rank 3")

    with WeightSender(bucket_bytes=1024, timeout_s=5, base_dir=base_dir) as sender:
        receiver = WeightReceiver(sender.control_path, timeout_s=5)
        sent, received = run_sides(lambda: sender.send(failing_export()), lambda: receive_all(receiver))
        assert isinstance(sent.error, ValueError)
        assert isinstance(received.error, PeerAborted) and "all-gather failed on rank 3" in str(
            received.error
        )
        assert_only_control_socket(sender, base_dir)
        weights = [("w", torch.randn(400))]
        assert_bitwise_equal(sync(sender, receiver, weights)[1], weights)


def test_receiver_that_stops_consuming_aborts_sender(base_dir: pathlib.Path) -> None:
    def take_one(receiver: WeightReceiver) -> None:
        iterator = receiver.receive()
        next(iterator)
        iterator.close()  # e.g. reload_weights raised on the first tensor

    with WeightSender(bucket_bytes=1024, timeout_s=5, base_dir=base_dir) as sender:
        receiver = WeightReceiver(sender.control_path, timeout_s=5)
        weights = [(f"w{i}", torch.randn(200)) for i in range(5)]
        sent, received = run_sides(lambda: sender.send(weights), lambda: take_one(receiver))
        assert received.error is None
        assert isinstance(sent.error, PeerAborted) and "stopped consuming" in str(sent.error)


def test_missing_peer_times_out_on_either_side(base_dir: pathlib.Path) -> None:
    with WeightSender(bucket_bytes=1024, timeout_s=0.5, base_dir=base_dir) as sender:
        no_receiver, no_sender = run_sides(lambda: sender.send([("w", torch.randn(4))]), lambda: None)
        assert isinstance(no_receiver.error, TransportTimeout) and no_receiver.seconds < 3
        receiver = WeightReceiver(sender.control_path, timeout_s=0.5)
        _, waiting = run_sides(lambda: None, lambda: receive_all(receiver))
        assert isinstance(waiting.error, TransportTimeout) and waiting.seconds < 3
        assert_only_control_socket(sender, base_dir)


def digest(name: str, tensor: torch.Tensor) -> list:
    return [
        name,
        str(tensor.dtype),
        list(tensor.shape),
        hashlib.sha256(as_bytes(tensor).numpy().tobytes()).hexdigest(),
    ]


def _receiver_reporting_digests(control_path: str, copies: list[bool], conn) -> None:
    receiver = WeightReceiver(control_path, timeout_s=30)
    for copy in copies:
        digests = [digest(name, tensor) for name, tensor in receiver.receive(copy=copy)]
        conn.send_bytes(json.dumps(digests).encode())  # JSON back to the test, no pickle


def test_round_trip_across_processes(base_dir: pathlib.Path) -> None:
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    syncs = [mixed_weights(), [("big", torch.randn(3000)), ("mask", torch.ones(3, dtype=torch.bool))]]
    with WeightSender(bucket_bytes=4096, timeout_s=30, base_dir=base_dir) as sender:
        child = context.Process(
            target=_receiver_reporting_digests,
            args=(str(sender.control_path), [True, False], child_conn),
            daemon=True,
        )
        child.start()
        try:
            for weights in syncs:
                sender.send(weights)
                assert parent_conn.poll(30), "the receiver process reported nothing"
                assert json.loads(parent_conn.recv_bytes()) == [digest(n, t) for n, t in weights]
            child.join(30)
            assert child.exitcode == 0
        finally:
            child.kill()
            child.join(10)


def _receiver_that_stalls(control_path: str, first_tensor_arrived) -> None:
    receiver = WeightReceiver(control_path, timeout_s=60)
    for _ in receiver.receive():
        first_tensor_arrived.set()
        time.sleep(120)  # killed by the test long before this ends


def test_killed_receiver_makes_sender_raise_within_timeout(base_dir: pathlib.Path) -> None:
    timeout_s = 20.0  # generous: the spawned child needs a few seconds to import torch
    context = multiprocessing.get_context("spawn")
    first_tensor_arrived = context.Event()
    weights = [(f"w{i}", torch.randn(200)) for i in range(20)]
    with WeightSender(bucket_bytes=1024, timeout_s=timeout_s, base_dir=base_dir) as sender:
        child = context.Process(
            target=_receiver_that_stalls, args=(str(sender.control_path), first_tensor_arrived), daemon=True
        )
        child.start()
        try:
            outcome = Outcome()

            def send() -> None:
                try:
                    outcome.value = sender.send(weights)
                except BaseException as exc:  # noqa: BLE001 - inspected below
                    outcome.error = exc

            sender_thread = threading.Thread(target=send, daemon=True)
            sender_thread.start()
            assert first_tensor_arrived.wait(60), "the receiver process never got a tensor"
            child.kill()
            killed_at = time.monotonic()
            sender_thread.join(timeout_s + 5)
            assert not sender_thread.is_alive(), "sender still waiting for a dead receiver"
            assert time.monotonic() - killed_at < timeout_s
            assert isinstance(outcome.error, PeerClosed), outcome.error
        finally:
            child.kill()
            child.join(10)
        assert_only_control_socket(sender, base_dir)


# ----------------------------------------------------------------------------- no pickle


class _WouldRunCode:
    """Unpickling this touches a marker file: proof that a payload was (not) unpickled."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


@pytest.mark.parametrize("framed", [False, True], ids=["raw_pickle", "pickle_in_json_frame"])
def test_receiver_rejects_pickle_payload(base_dir: pathlib.Path, framed: bool) -> None:
    marker = base_dir / "unpickled"
    payload = pickle.dumps(_WouldRunCode(marker))
    fake_dir = make_private_dir(base_dir, "fake-")
    server = listen_unix(fake_dir / "c")

    def fake_sender() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            conn.recv(4096)  # the receiver's hello
            conn.sendall(MAGIC + struct.pack(">I", len(payload)) + payload if framed else payload)
            time.sleep(0.2)

    receiver = WeightReceiver(fake_dir / "c", timeout_s=5)
    try:
        _, received = run_sides(fake_sender, lambda: receive_all(receiver))
    finally:
        server.close()
        shutil.rmtree(fake_dir)
    assert isinstance(received.error, ProtocolError)
    assert "pickle" in str(received.error)
    assert not marker.exists()


def test_sender_rejects_pickle_hello_then_next_sync_works(base_dir: pathlib.Path) -> None:
    import socket

    marker = base_dir / "unpickled"
    with WeightSender(bucket_bytes=1024, timeout_s=5, base_dir=base_dir) as sender:

        def attacker() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(os.fspath(sender.control_path))
                conn.sendall(pickle.dumps(_WouldRunCode(marker)))
                time.sleep(0.5)

        sent, _ = run_sides(lambda: sender.send([("w", torch.randn(4))]), attacker)
        assert isinstance(sent.error, ProtocolError) and "pickle" in str(sent.error)
        assert not marker.exists()
        assert_only_control_socket(sender, base_dir)
        weights = [("w", torch.randn(4))]
        assert_bitwise_equal(
            sync(sender, WeightReceiver(sender.control_path, timeout_s=5), weights)[1], weights
        )


# ----------------------------------------------------------------------------- layout


def test_packer_aligns_entries_and_chunks_oversized_tensors() -> None:
    bucket_bytes = 1024
    slots = [torch.zeros(bucket_bytes, dtype=torch.uint8) for _ in range(2)]
    packer = BucketPacker(slots, bucket_bytes)
    buckets = [
        (b.bucket_id, b.slot, list(b.entries))
        for b in packer.buckets(
            [("a", torch.ones(3, dtype=torch.bool)), ("b", torch.ones(600)), ("c", torch.ones(10))]
        )
    ]
    entries = [entry for _, _, bucket_entries in buckets for entry in bucket_entries]
    assert all(entry.offset % ALIGN_BYTES == 0 for entry in entries)
    assert [b[1] for b in buckets] == [i % 2 for i in range(len(buckets))]
    b_chunks = [entry for entry in entries if entry.name == "b"]
    assert b_chunks[0].offset == ALIGN_BYTES and b_chunks[0].nbytes == bucket_bytes - ALIGN_BYTES
    assert sum(entry.nbytes for entry in b_chunks) == 2400 and len(b_chunks) == b_chunks[0].chunk_count == 3
    with pytest.raises(ValueError, match="multiple of 256"):
        BucketPacker(slots, 1000)


@pytest.mark.parametrize(
    "bad",
    [
        {"offset": 128},  # misaligned
        {"offset": 1024},  # past the end of the bucket
        {"dtype": "object"},
        {"shape": [-1]},
        {"nbytes": 12},  # does not match shape x itemsize
        {"chunk_index": 3, "chunk_count": 3},
    ],
)
def test_entry_metadata_is_bounds_checked(bad: dict) -> None:
    good = Entry("w", "float32", (4,), 0, 16).to_json()
    assert Entry.from_json(good, 1024).nbytes == 16
    with pytest.raises(ProtocolError):
        Entry.from_json({**good, **bad}, 1024)
