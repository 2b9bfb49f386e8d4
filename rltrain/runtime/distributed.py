"""Process-group set-up and the collective helpers every module shares, with their device rule.

Model tensors live on the training device and small control tensors on the CPU; one default group
(`"cpu:gloo,cuda:nccl"` on CUDA) serves both, so no caller needs to know which device a collective
wants. Every collective inherits `safety.collective_timeout_s`, so a lost peer is an error, not a
hang. The rule and the `RLTRAIN_DIST_BACKEND` override: docs/internals/runtime.md.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BACKEND_ENV = "RLTRAIN_DIST_BACKEND"


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_backend(cuda: bool) -> str:
    """The backend string for the default group (see the module docstring)."""
    override = os.environ.get(BACKEND_ENV, "").strip()
    if override:
        return override
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def training_device(local_rank: int) -> torch.device:
    """This rank's device: its GPU (ranks beyond the GPU count share them round-robin, which only
    a gloo group can serve), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_distributed(timeout_s: float) -> DistInfo:
    """Join (or create, for a single local rank) the default process group from the env:// variables."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = training_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = default_backend(device.type == "cuda")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if device.type == "cuda" and "nccl" in backend and local_world > torch.cuda.device_count():
            from rltrain.runtime.errors import UserError

            raise UserError(
                f"{local_world} ranks on this machine but only {torch.cuda.device_count()} GPU(s): NCCL needs one GPU "
                f"per rank. Lower trainer.nproc / --nproc_per_node, or set {BACKEND_ENV}=gloo to share GPUs over "
                "gloo (slow; for testing)."
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict[str, Any] = {}
        if device.type == "cuda" and backend == "nccl":
            kwargs["device_id"] = device
        global _hosted_store
        if _hosted_store is not None:
            # Under the prefix torch's env:// rendezvous gives the other ranks' clients of this store.
            kwargs["store"], _hosted_store = dist.PrefixStore("default_pg", _hosted_store), None
        elif world == 1 and "MASTER_ADDR" not in os.environ:
            kwargs["store"] = _single_rank_store(timeout)
        with _rendezvous_watchdog(rank, timeout_s):
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistInfo(rank, world, local_rank, device)


_hosted_store: dist.TCPStore | None = None


def host_rendezvous_store(world: int, timeout_s: float) -> int:
    """Start the rendezvous store of a `world`-rank run in this process (its rank 0) on a port the
    kernel picks as it binds, and return the port; this process's `init_distributed` joins through
    it. For launchers whose ranks share no launcher process (rltrain/launch/submitit_ranks.py)."""
    global _hosted_store
    timeout = datetime.timedelta(seconds=timeout_s)
    _hosted_store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    return _hosted_store.port


@contextmanager
def _rendezvous_watchdog(rank: int, timeout_s: float) -> Iterator[None]:
    """End the process with a paragraph if joining the process group outlives its timeout. torch's
    timeout covers a store that is absent, not a port held by another program: a rank that
    connects to a listener which is not a rendezvous store waits for an answer forever."""
    grace_s = min(30.0, timeout_s)  # past torch's own timeout, whose error says more when it comes

    def give_up() -> None:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        print(
            f"rltrain: error: rank {rank} could not join the process group at {where} within "
            f"{timeout_s + grace_s:.0f} s (safety.collective_timeout_s + {grace_s:.0f}): another program may be "
            "listening on that port, or rank 0 never started. Choose a free MASTER_PORT (torchrun --master_port) "
            "and check rank 0's log.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(timeout_s + grace_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _single_rank_store(timeout: datetime.timedelta) -> dist.TCPStore:
    """A single local rank's store on a port the kernel picks as it binds: asking for a free port
    first and binding it later would leave a moment in which another process could take it. The
    env:// variables then name it, as a launcher's would (libraries that read them find the run's)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(store.port)
    return store


def control_device() -> torch.device:
    """Where small control and metric tensors of collectives live: the CPU, unless the default
    group cannot carry CPU tensors (NCCL alone), then this rank's GPU."""
    if dist.is_initialized() and "gloo" not in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A small tensor for a collective, on `control_device()`."""
    return torch.tensor(values, dtype=dtype, device=control_device())


def broadcast_str(text: str | None, src: int = 0, group: dist.ProcessGroup | None = None) -> str:
    """Broadcast a string from global rank `src` over `group` as raw UTF-8 bytes (no pickle)."""
    if dist.get_world_size(group) == 1:
        assert text is not None
        return text
    data = (text or "").encode()
    length = control_tensor([len(data)], torch.long)
    dist.broadcast(length, src, group=group)
    buf = torch.zeros(int(length), dtype=torch.uint8, device=control_device())
    if dist.get_rank() == src and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src, group=group)
    return bytes(buf.tolist()).decode()


def share_lists(
    ints: list[int] | None, floats: list[float] | None, src: int, group: dist.ProcessGroup | None = None
) -> tuple[list[int], list[float]]:
    """Global rank `src`'s int64 and float64 lists on every rank of `group` (the others pass None):
    raw tensors, never pickle, so floats arrive bitwise."""
    device = control_device()
    if dist.get_rank() == src:
        if ints is None or floats is None:
            raise ValueError("the sending rank must pass its lists")
        header = control_tensor([len(ints), len(floats)], torch.int64)
    else:
        header = torch.empty(2, dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    n_ints, n_floats = (int(v) for v in header.tolist())
    if dist.get_rank() == src:
        assert ints is not None and floats is not None
        int_t, float_t = control_tensor(ints, torch.int64), control_tensor(floats, torch.float64)
    else:
        int_t = torch.empty(n_ints, dtype=torch.int64, device=device)
        float_t = torch.empty(n_floats, dtype=torch.float64, device=device)
    if n_ints:
        dist.broadcast(int_t, src, group=group)
    if n_floats:
        dist.broadcast(float_t, src, group=group)
    return int_t.tolist(), float_t.tolist()


def texts_to_ints(texts: list[str]) -> list[int]:
    """`texts` as [count, byte length of each, UTF-8 bytes...], for `share_lists`."""
    encoded = [t.encode() for t in texts]
    return [len(encoded), *(len(b) for b in encoded), *(byte for b in encoded for byte in b)]


def texts_from_ints(ints: list[int]) -> list[str]:
    """The inverse of `texts_to_ints`."""
    n, data, texts = ints[0], bytes(ints[1 + ints[0] :]), []
    start = 0
    for length in ints[1 : 1 + n]:
        texts.append(data[start : start + length].decode())
        start += length
    return texts


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_ranks_agree(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True only if `flag` is true on every rank of `group` (one MIN all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = control_tensor([1 if flag else 0], torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def agree_or_raise(ok: bool, what: str, cause: BaseException | None = None) -> None:
    """Raise on every rank unless `ok` on every rank (one MIN all-reduce on the world group)."""
    if not all_ranks_agree(ok):
        raise RuntimeError(f"{what} failed on at least one rank; see that rank's error") from cause


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """SUM-all-reduce a control tensor in place on `control_device()`; returns it (on its own
    device). A tensor from the model's device is moved there and back."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    staged = values.to(control_device())
    dist.all_reduce(staged, group=group)
    return staged.to(values.device)


def global_max(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest `value` over the ranks of `group`."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = control_tensor([value], torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


# One all-gather into a single tensor. torch 2.13 (the venv's pin) names it `all_gather_single`
# and warns (FutureWarning, on every rank) at each call of the old name; torch 2.11 (the GPU
# image) has only the old name.
_all_gather_single = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor


def gather_rows(local: torch.Tensor, full_rows: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full tensor whose dim-0 shards (`torch.chunk` layout, as FSDP2 shards parameters) the
    ranks of `group` hold, on every rank. One all-gather into a single tensor of equal, zero-padded pieces:
    unlike DTensor's `full_tensor` (functional collectives), it runs on gloo with CUDA tensors too,
    which is how several ranks share one GPU."""
    world = dist.get_world_size(group)
    per_rank = -(-full_rows // world)
    padded = local.new_zeros((per_rank, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((per_rank * world, *local.shape[1:]))
    _all_gather_single(out, padded.contiguous(), group=group)
    return out[:full_rows]


def _through_host(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """gloo's point-to-point transport reads and writes host memory only: a CUDA tensor sent over a
    gloo group (several ranks sharing a GPU) is staged through a CPU copy. NCCL takes it as is."""
    return tensor.device.type == "cuda" and "nccl" not in str(dist.get_backend(group))


class SendHandle:
    """An asynchronous send and the buffer it reads, kept alive until `wait()`."""

    def __init__(self, work, buffer: torch.Tensor) -> None:
        self.work, self.buffer = work, buffer

    def wait(self) -> None:
        self.work.wait()


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> SendHandle:
    buffer = tensor.cpu() if _through_host(tensor, group) else tensor
    return SendHandle(dist.isend(buffer, dst=dst, group=group), buffer)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Receive into `tensor` (on any device; see `_through_host`)."""
    if _through_host(tensor, group):
        staged = torch.empty_like(tensor, device="cpu")
        dist.recv(staged, src=src, group=group)
        tensor.copy_(staged)
    else:
        dist.recv(tensor, src=src, group=group)
