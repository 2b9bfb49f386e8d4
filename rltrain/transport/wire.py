"""Control plane of the weight transport: Unix sockets, framed JSON messages, errors.

Everything that crosses a socket between the trainer and the rollout process goes through `Channel`,
so the two rules that keep that boundary safe live in one place: JSON only, never pickle, and every
wait bounded. docs/internals/sync.md describes the frames and the errors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from rltrain.transport.protocol import MAGIC, MAX_MESSAGE_BYTES, MESSAGE_TYPES

Message = dict[str, Any]

_HEADER = struct.Struct(">4sI")  # magic, body length
_FDS_MARKER = b"F"  # the byte that carries passed descriptors
_ABORT_SEND_TIMEOUT_S = 1.0  # an abort is a courtesy: never let it block the error path
_MAX_UNIX_PATH_BYTES = 104  # sun_path is 108 bytes on Linux, 104 on macOS


class TransportError(RuntimeError):
    """Base class: a weight sync failed; the next sync starts from fresh sockets and segments."""


class ProtocolError(TransportError):
    """The peer sent something that is not the expected JSON message (wrong tags, a pickle,
    malformed metadata, missing chunks)."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait exceeded `timeout_s`: the peer is stalled or gone."""


class PeerClosed(TransportError):
    """The peer closed the connection (it exited or was killed)."""


class PeerAborted(TransportError):
    """The peer sent `abort`: it hit an error and gave up on this sync."""


def make_private_dir(base_dir: str | os.PathLike[str] | None, prefix: str) -> Path:
    """A fresh directory only this user can enter (mode 0700), so no other user or job can
    connect to the sockets inside it and two engines on one host never share a path."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base_dir))  # mkdtemp creates it 0700
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode != 0o700:
        path.rmdir()
        raise TransportError(f"private directory {path} was created with mode {oct(mode)}, expected 0o700")
    return path


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > _MAX_UNIX_PATH_BYTES:
        raise TransportError(
            f"socket path {path} is longer than {_MAX_UNIX_PATH_BYTES} bytes, the limit for Unix sockets; "
            "pass a shorter base_dir"
        )


def listen_unix(path: Path, backlog: int = 4) -> socket.socket:
    """A listening Unix stream socket at `path` (which must not exist yet)."""
    _check_socket_path(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(os.fspath(path))
        server.listen(backlog)
    except BaseException:
        server.close()
        raise
    return server


def accept_until(server: socket.socket, deadline: float, what: str) -> socket.socket:
    """Accept one connection before `deadline` (time.monotonic), or raise TransportTimeout."""
    server.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        conn, _ = server.accept()
    except TimeoutError as exc:
        raise TransportTimeout(f"timed out waiting for {what}") from exc
    conn.settimeout(None)
    return conn


def connect_unix(path: str, deadline: float, what: str, retry: bool) -> socket.socket:
    """Connect to the Unix socket at `path`. With `retry`, keep trying while the listener does not
    exist yet (the peer is starting or re-creating it) until `deadline`."""
    _check_socket_path(Path(path))
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))
            conn.connect(path)
            conn.settimeout(None)
            return conn
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            conn.close()
            if not retry:
                raise PeerClosed(f"{what} at {path} is gone (the peer aborted or died)") from exc
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"timed out connecting to {what} at {path}") from exc
            time.sleep(0.02)
        except TimeoutError as exc:
            conn.close()
            raise TransportTimeout(f"timed out connecting to {what} at {path}") from exc
        except BaseException:
            conn.close()
            raise


def _describe_garbage(data: bytes) -> str:
    hint = " (this looks like a pickle stream, which is never accepted)" if data[:1] == b"\x80" else ""
    return f"bytes starting with {data[:8]!r}{hint}"


class Channel:
    """One connected stream socket carrying framed JSON messages with a per-wait deadline.

    `peer` names the other side in error messages ("receiver", "sender")."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.sock.close()

    def send(self, message: Message) -> None:
        body = json.dumps(message, separators=(",", ":")).encode()
        if len(body) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
        self.sock.settimeout(self.timeout_s)
        try:
            self.sock.sendall(_HEADER.pack(MAGIC, len(body)) + body)
        except TimeoutError as exc:
            raise TransportTimeout(f"timed out after {self.timeout_s}s sending to the {self.peer}") from exc
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._raise_pending_abort()
            raise PeerClosed(f"the {self.peer} closed the connection (it exited or was killed)") from exc

    def recv(self, what: str) -> Message:
        """The next message, waiting at most `timeout_s`. `what` says what we wait for, for the
        error message. An `abort` from the peer raises PeerAborted."""
        message = decode_message(self.recv_body(what), self.peer)
        if message["type"] == "abort":
            raise PeerAborted(
                f"the {self.peer} aborted sync {message['sync_id']} at bucket {message['bucket_id']}: "
                f"{message.get('reason', 'no reason given')}"
            )
        return message

    def recv_body(self, what: str) -> bytes:
        """The body of the next frame (not yet decoded), waiting at most `timeout_s`; anything
        that is not a frame (a pickle stream, say) raises before it is read further."""
        deadline = time.monotonic() + self.timeout_s
        header = self._recv_exact(_HEADER.size, deadline, what)
        magic, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(
                f"expected a framed JSON message from the {self.peer}, got {_describe_garbage(header)}"
            )
        if length > MAX_MESSAGE_BYTES:
            raise ProtocolError(
                f"message length {length} from the {self.peer} exceeds {MAX_MESSAGE_BYTES} bytes"
            )
        return self._recv_exact(length, deadline, what)

    def send_fds(self, fds: list[int]) -> None:
        """Pass open descriptors (shared-memory segments) to the peer: one marker byte carrying
        them as SCM_RIGHTS ancillary data, right after the JSON message that announces them."""
        self.sock.settimeout(self.timeout_s)
        try:
            socket.send_fds(self.sock, [_FDS_MARKER], fds)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise PeerClosed(f"the {self.peer} closed the connection (it exited or was killed)") from exc

    def recv_fds(self, count: int, what: str) -> list[int]:
        """Receive exactly `count` descriptors sent with `send_fds`; the caller owns them."""
        self.sock.settimeout(self.timeout_s)
        try:
            marker, fds, flags, _ = socket.recv_fds(self.sock, 1, count + 1)
        except TimeoutError as exc:
            raise TransportTimeout(
                f"timed out after {self.timeout_s}s waiting for {what} from the {self.peer}"
            ) from exc
        for fd in fds:
            os.set_inheritable(fd, False)
        if marker != _FDS_MARKER or len(fds) != count or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            if not marker:
                raise PeerClosed(f"the {self.peer} closed the connection while we waited for {what}")
            raise ProtocolError(
                f"expected {count} descriptors ({what}) from the {self.peer}, got {len(fds)} "
                f"with marker {marker!r}"
            )
        return fds

    def abort(self, sync_id: int, bucket_id: int, reason: str) -> None:
        """Tell the peer to give up now instead of waiting for its timeout. Best effort: the
        peer may already be gone, and this must never mask the error being reported."""
        with contextlib.suppress(OSError, TransportError):
            self.timeout_s = min(self.timeout_s, _ABORT_SEND_TIMEOUT_S)
            self.send({"type": "abort", "sync_id": sync_id, "bucket_id": bucket_id, "reason": reason[:2000]})

    def _raise_pending_abort(self) -> None:
        """Our send failed because the peer closed; if it left an `abort` with its reason in our
        receive queue first, raise that (PeerAborted) instead of a bare PeerClosed."""
        self.timeout_s = min(self.timeout_s, _ABORT_SEND_TIMEOUT_S)
        try:
            self.recv("a pending abort")
        except PeerAborted:
            raise
        except (OSError, TransportError):
            return  # no abort was waiting: the caller raises its own error

    def _recv_exact(self, nbytes: int, deadline: float, what: str) -> bytes:
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        received = 0
        while received < nbytes:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TransportTimeout(
                    f"timed out after {self.timeout_s}s waiting for {what} from the {self.peer}"
                )
            self.sock.settimeout(remaining_s)
            try:
                count = self.sock.recv_into(view[received:])
            except TimeoutError as exc:
                raise TransportTimeout(
                    f"timed out after {self.timeout_s}s waiting for {what} from the {self.peer}"
                ) from exc
            except OSError as exc:
                if exc.errno in (errno.ECONNRESET, errno.EPIPE):
                    raise PeerClosed(
                        f"the {self.peer} reset the connection while we waited for {what}"
                    ) from exc
                raise
            if count == 0:
                raise PeerClosed(
                    f"the {self.peer} closed the connection while we waited for {what} (it exited or was killed)"
                )
            received += count
        return bytes(buffer)


def decode_message(body: bytes, peer: str) -> Message:
    """Parse one frame body: a JSON object with a known `type` and integer tags, nothing else."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"message from the {peer} is not JSON: {_describe_garbage(body)}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"message from the {peer} is a JSON {type(message).__name__}, expected an object")
    kind = message.get("type")
    if kind not in MESSAGE_TYPES:
        raise ProtocolError(f"message from the {peer} has unknown type {kind!r}")
    for tag in ("sync_id", "bucket_id"):
        if type(message.get(tag)) is not int:
            raise ProtocolError(f"{kind!r} message from the {peer} lacks an integer {tag!r}")
    return message


def expect(message: Message, kind: str, sync_id: int, bucket_id: int, peer: str) -> Message:
    """Check that `message` is the reply we wait for: right type, sync and bucket."""
    if message["type"] != kind or message["sync_id"] != sync_id or message["bucket_id"] != bucket_id:
        raise ProtocolError(
            f"expected {kind!r} for sync {sync_id} bucket {bucket_id} from the {peer}, got "
            f"{message['type']!r} for sync {message['sync_id']} bucket {message['bucket_id']}"
        )
    return message
