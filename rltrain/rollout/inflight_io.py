"""The in-flight loop's two threads on the control channel (rltrain/rollout/inflight_child.py): the
replies written, the trainer's requests read, so that neither a large answer nor a pushed version
waits on a decoding step (docs/async.md, "Weights in flight").
"""

from __future__ import annotations

import queue
import select
import threading
from typing import TYPE_CHECKING, Any

from rltrain.transport.wire import PeerClosed

if TYPE_CHECKING:
    from rltrain.rollout.control_wire import ControlChannel
    from rltrain.transport.receiver import WeightReceiver


class Outbox:
    """The loop's replies, written by a thread of their own: a batch's answer can outgrow the
    socket's buffer while the trainer, which asked for it a step ahead, is still busy (or pushing
    weights that this loop must receive). Written in order; a failed write stops the loop."""

    def __init__(self, channel: ControlChannel) -> None:
        # Its own socket object (the same connection): its send timeout never meets the reader's.
        self.channel = type(channel)(channel.sock.dup(), channel.peer, channel.timeout_s)
        self.queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._write, name="rltrain-stream-outbox", daemon=True)
        self.thread.start()

    def send(self, message: dict[str, Any]) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(message)

    def _write(self) -> None:
        while (message := self.queue.get()) is not None:
            try:
                self.channel.send(message)
            except BaseException as exc:  # noqa: BLE001 - the loop raises it at its next send
                self.error = exc
                return

    def close(self) -> None:
        """Everything queued written (each write bounded by the channel's timeout), then the thread ends."""
        self.queue.put(None)
        self.thread.join()
        self.channel.close()


class Inbox:
    """The trainer's requests, read by a thread of their own, which also receives each pushed
    version's weights into host memory at once and answers the push: the trainer's push never waits
    for the decoding step in progress (the loop loads the version between two steps, as before).
    The loop takes the requests in arrival order from `queue`; `_weights` carries a received version,
    `_closed` the trainer's end of the channel, `_failed` a receive that failed."""

    def __init__(self, channel: ControlChannel, receiver: WeightReceiver, outbox: Outbox) -> None:
        self.channel, self.receiver, self.outbox = channel, receiver, outbox
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._read, name="rltrain-stream-inbox", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            going = True
            while going:
                going = self._take_one()
        except PeerClosed:
            self.queue.put({"op": "_closed", "id": -1})
        except BaseException as exc:  # noqa: BLE001 - the loop raises it (and so ends, as the trainer's side sees)
            self.queue.put({"op": "_failed", "id": -1, "error": exc})

    def _take_one(self) -> bool:
        """Read one request (an `update`: its weights too); False after `close`."""
        select.select([self.channel.sock], [], [])
        message = self.channel.recv("a request")
        if message["op"] == "update":
            weights = list(self.receiver.receive(copy=True))
            self.queue.put({"op": "_weights", "id": message["id"], "weights": weights})
            self.outbox.send({"op": "reply", "id": message["id"], "ok": True})
            return True
        self.queue.put(message)
        return message["op"] != "close"
