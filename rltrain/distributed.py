"""Process-group set-up shared by every entry point (local spawn, torchrun, tests).

Backend: NCCL where CUDA is present, gloo otherwise. Every collective inherits the process-group
timeout `safety.collective_timeout_s`, so a lost peer turns into an error instead of a hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float) -> DistInfo:
    """Join (or create, for a single local rank) the default process group from the env:// variables."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        if world == 1 and "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistInfo(rank, world, local_rank, device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast_str(text: str | None, src: int = 0) -> str:
    """Broadcast a string from `src` as raw UTF-8 bytes (no pickle)."""
    if dist.get_world_size() == 1:
        assert text is not None
        return text
    data = (text or "").encode()
    length = torch.tensor([len(data)], dtype=torch.long)
    dist.broadcast(length, src)
    buf = torch.zeros(int(length), dtype=torch.uint8)
    if dist.get_rank() == src and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src)
    return bytes(buf.tolist()).decode()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_ranks_agree(flag: bool) -> bool:
    """True only if `flag` is true on every rank (one MIN all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
