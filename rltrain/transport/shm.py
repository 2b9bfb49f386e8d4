"""Data plane of the weight transport: anonymous POSIX shared-memory segments as uint8 tensors.

Segments are unlinked at once and handed over as file descriptors, so nothing is ever left in
/dev/shm whoever dies, and they are allocated up front, so a full /dev/shm is a clear error, not a
SIGBUS. docs/internals/sync.md explains why not `multiprocessing.shared_memory` and `RLTRAIN_SHM_DIR`.
"""

from __future__ import annotations

import _posixshmem
import errno
import mmap
import os
import secrets
import stat

import torch

from rltrain.runtime.errors import UserError
from rltrain.transport.protocol import SEGMENT_PREFIX, SHM_DIR_ENV
from rltrain.transport.wire import ProtocolError


class SharedMemoryFull(UserError):
    """The shared memory for the weight transport's buckets cannot be allocated."""


def shm_dir() -> str:
    return os.environ.get(SHM_DIR_ENV) or "/dev/shm"


def _free_mib(directory: str) -> str:
    try:
        st = os.statvfs(directory)
    except OSError:
        return "unknown"
    return f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB"


def shm_full_error(needed_bytes: int, what: str) -> SharedMemoryFull:
    directory = shm_dir()
    return SharedMemoryFull(
        f"cannot allocate {what} of shared memory in {directory} ({_free_mib(directory)}) for the weight "
        f"transport of the separate rollout process: it needs {needed_bytes / 2**20:.0f} MiB per rank (2 buckets "
        "of rollout.bucket_mb each) for the whole run. Give the machine more shared memory (Docker: "
        "`docker run --shm-size=1g ...`; Kubernetes: an emptyDir with medium Memory on /dev/shm), or lower "
        "rollout.bucket_mb."
    )


def _open_anonymous() -> int:
    """A new shared-memory file descriptor whose name is already gone."""
    directory = os.environ.get(SHM_DIR_ENV)
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    if directory:
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(path)
        return fd
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    _posixshmem.shm_unlink("/" + name)
    return fd


def allocate(fd: int, nbytes: int) -> None:
    """Give the segment its pages now: ENOSPC here, not SIGBUS at the first write past the space."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise shm_full_error(nbytes, f"a {nbytes / 2**20:.0f} MiB bucket") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # a filesystem without fallocate: sparse, as before


class SharedSegment:
    """A fixed-size shared-memory segment mapped read/write as a 1-D uint8 tensor (`bytes_u8`).

    The sender's segments keep their descriptor (`fd`) to pass it on; the receiver's close it
    right after mapping."""

    def __init__(self, fd: int | None, nbytes: int, mapping: mmap.mmap, identity: tuple[int, int]) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.identity = identity  # (st_dev, st_ino): the same memory seen through another fd
        self._mapping: mmap.mmap | None = mapping
        self._bytes_u8: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)

    @property
    def bytes_u8(self) -> torch.Tensor:
        if self._bytes_u8 is None:
            raise ProtocolError("this shared-memory segment is closed")
        return self._bytes_u8

    @property
    def sender_fd(self) -> int:
        """The descriptor to pass to the receiver (only the sender's open segments have one)."""
        if self.fd is None:
            raise ProtocolError("this shared-memory segment has no descriptor to send")
        return self.fd

    @classmethod
    def create(cls, nbytes: int) -> SharedSegment:
        """A new anonymous segment of `nbytes` (its name is unlinked before this returns)."""
        fd = _open_anonymous()
        try:
            allocate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes)
            info = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, nbytes, mapping, (info.st_dev, info.st_ino))

    @classmethod
    def from_fd(cls, fd: int, nbytes: int) -> SharedSegment:
        """Map a descriptor received from the sender, after checking it is a segment big enough.
        Takes ownership of `fd` (closed here, whatever happens)."""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < nbytes:
                raise ProtocolError(
                    f"received descriptor is not a shared-memory segment of {nbytes} bytes "
                    f"(mode {oct(info.st_mode)}, size {info.st_size})"
                )
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return cls(None, nbytes, mapping, (info.st_dev, info.st_ino))

    def close(self) -> None:
        """Close our descriptor and drop our references to the mapping (idempotent).

        We never call `mmap.close()`: `torch.frombuffer` does not pin the buffer export, so
        closing would unmap memory under any view still alive (a zero-copy tensor a consumer
        kept) and turn its next read into a segfault. The tensor storage holds a reference to
        the mmap object instead, so the mapping goes away exactly when the last view dies."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._bytes_u8 = None
        self._mapping = None
