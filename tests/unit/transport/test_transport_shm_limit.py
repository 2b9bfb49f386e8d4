"""Shared memory is allocated up front: a /dev/shm too small for the weight transport's buckets
fails at the first sync with a UserError naming the size needed and the fix, never with SIGBUS."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
from helpers import mounted_tmpfs

from rltrain.runtime.errors import UserError
from rltrain.transport import shm as transport_shm
from rltrain.transport.protocol import SHM_DIR_ENV
from rltrain.transport.receiver import WeightReceiver
from rltrain.transport.sender import WeightSender
from rltrain.transport.shm import SharedMemoryFull, SharedSegment

MIB = 1 << 20


@pytest.fixture
def small_tmpfs():
    """A 6 MiB tmpfs (root may mount one; skipped where mounting is refused)."""
    with mounted_tmpfs("6m") as where:
        yield where


def test_segments_take_their_pages_at_creation(monkeypatch, small_tmpfs):
    monkeypatch.setenv(SHM_DIR_ENV, str(small_tmpfs))
    segment = SharedSegment.create(4 * MIB)
    try:
        assert os.fstat(segment.fd).st_blocks * 512 >= 4 * MIB  # allocated, not sparse
        assert list(small_tmpfs.iterdir()) == []  # nameless, as in /dev/shm
        with pytest.raises(SharedMemoryFull, match="cannot allocate a 4 MiB bucket"):
            SharedSegment.create(4 * MIB)  # 8 MiB do not fit in 6
    finally:
        segment.close()


def test_a_too_small_shm_fails_at_the_first_sync_with_the_size_and_the_fix(monkeypatch, small_tmpfs):
    monkeypatch.setenv(SHM_DIR_ENV, str(small_tmpfs))
    base = pathlib.Path(tempfile.mkdtemp(prefix="rlt-", dir="/tmp"))
    with WeightSender(bucket_bytes=4 * MIB, timeout_s=5, base_dir=base) as sender:
        with pytest.raises(UserError) as info:
            sender.send([("w", torch.ones(10))])
        message = str(info.value)
        assert "2 buckets of 4 MiB" in message and "needs 8 MiB per rank" in message
        assert str(small_tmpfs) in message and "--shm-size" in message and "rollout.bucket_mb" in message
        assert os.statvfs(small_tmpfs).f_bfree == os.statvfs(small_tmpfs).f_blocks  # nothing held

        # Buckets that fit work, through the same directory.
        small = WeightSender(bucket_bytes=1 * MIB, timeout_s=5, base_dir=base)
        with small, WeightReceiver(small.control_path, timeout_s=5) as receiver:
            got = []
            thread = threading.Thread(target=lambda: got.extend(receiver.receive()))
            thread.start()
            small.send([("w", torch.arange(300_000, dtype=torch.float32))])
            thread.join(10)
            assert torch.equal(got[0][1], torch.arange(300_000, dtype=torch.float32))


def test_enospc_from_fallocate_is_a_user_error(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transport_shm.os, "posix_fallocate", full)
    with pytest.raises(SharedMemoryFull, match="/dev/shm"):
        SharedSegment.create(64 * MIB)


def test_sparse_segments_would_have_died_of_sigbus(small_tmpfs):
    """Why the allocation matters: the same too-big segment left sparse kills its process."""
    code = (
        "import mmap, os, sys\n"
        "fd = os.open(os.path.join(sys.argv[1], 'x'), os.O_CREAT | os.O_RDWR, 0o600)\n"
        "os.ftruncate(fd, 16 << 20)\n"
        "m = mmap.mmap(fd, 16 << 20)\n"
        "m[:] = b'1' * (16 << 20)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(small_tmpfs)], capture_output=True, timeout=60)
    assert proc.returncode == -7  # SIGBUS, no traceback: what rltrain's own check spares its users
