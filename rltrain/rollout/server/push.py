"""The weight push to one vLLM API server: a two-member torch.distributed group (gloo on CPU, NCCL
on GPU: `push_backend`) opened through the server's `/collective_rpc`, then per version a JSON
manifest (names, dtypes, shapes, offsets: never pickle) and the buckets' raw bytes as broadcasts,
and with them, in the same request (rollout/server/load_route.py), the server's prefix- and
encoder-cache resets and its vLLM weight version, which every completion then reports. The fleet
pushes to its servers at once (`run_each`). The worker's end is rltrain/rollout/server/extension.py;
docs/rollout-servers.md.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, get_args

import torch

from rltrain.config.group_options import PushBackend
from rltrain.rollout.server.client import LOAD_PATH, ServerDown, ServerRefused, call, collective_rpc
from rltrain.rollout.server.extension import open_pair_group, pair_store
from rltrain.runtime.errors import UserError
from rltrain.transport.buckets import align_up, dtype_name

Weights = Iterable[tuple[str, torch.Tensor]]
PUSH_BACKENDS: tuple[str, ...] = get_args(PushBackend)  # rollout.servers.push_backend
# The fix first: the fleet's all-down message keeps 200 characters of a server's last error.
NCCL_HINT = (
    "set rollout.servers.push_backend=gloo to push from host memory: NCCL refuses two processes on one GPU "
    "(a server on the trainer's GPU) and needs a route between the machines"
)


def needs_server_device(setting: str, trainer_cuda: bool, spawned: bool) -> bool:
    """Whether `push_backend` needs to know the server's device (one more RPC per join): only
    where NCCL is still possible, so a CPU trainer's join is what it was."""
    return trainer_cuda and (setting == "nccl" or (setting == "auto" and not spawned))


def push_backend(setting: str, *, trainer_cuda: bool, server_device: str | None, spawned: bool, url: str) -> str:
    """The pair group's backend for one server (`rollout.servers.push_backend`). `auto`: NCCL where
    both ends run on CUDA and the server is not one this trainer spawned (it would share the
    trainer's GPU, which NCCL refuses); gloo otherwise. `server_device` is what the server's
    worker reports ("cpu", "cuda"), None where it was not asked (`needs_server_device`)."""
    if setting == "gloo":
        return "gloo"
    if setting == "auto":
        return "nccl" if trainer_cuda and server_device == "cuda" and not spawned else "gloo"
    if setting != "nccl":
        raise UserError(f"rollout.servers.push_backend={setting!r} is not one of {', '.join(PUSH_BACKENDS)}.")
    if not trainer_cuda or server_device != "cuda":
        where = "the trainer runs on the CPU" if not trainer_cuda else f"{url} runs its model on {server_device}"
        raise UserError(
            f"rollout.servers.push_backend=nccl for {url}, but {where}: NCCL pushes from GPU to GPU only. Set "
            "rollout.servers.push_backend=gloo (or auto, which picks NCCL only where both ends run on CUDA)."
        )
    return "nccl"


def server_device(url: str, timeout_s: float) -> str:
    """Where the server's workers hold the model: "cuda" when every worker answers "cuda"."""
    devices = [str(d) for d in collective_rpc(url, "rltrain_device", [], timeout_s)]
    if devices and all(d == "cuda" for d in devices):
        return "cuda"
    return next((d for d in devices if d != "cuda"), "cpu")


def run_each(jobs: list[Callable[[], None]]) -> list[BaseException | None]:
    """Every job at once, a thread each (a single job on the caller's thread); what each raised, or
    None. N servers then take the time of the slowest push, not the sum; each still gets its own
    copy from rank 0 (docs/rollout-servers.md)."""
    if len(jobs) <= 1:
        return [_raised(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [future.exception() for future in futures]


def _raised(job: Callable[[], None]) -> BaseException | None:
    try:
        job()
    except Exception as exc:  # noqa: BLE001 - handed to the caller, who decides per server
        return exc
    return None


def checkpoint_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The model directory's weights (version 0, what a server that joins is reset to), by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file), device="cpu"))
    return sorted(tensors.items())


def buckets_of(weights: Weights, bucket_bytes: int) -> Iterator[tuple[torch.Tensor, list[list[Any]]]]:
    """(bucket_u8, entries) with entries [name, dtype, shape, offset]; a tensor larger than a
    bucket gets a bucket of its own."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> tuple[torch.Tensor, list[list[Any]]]:
        bucket_u8 = torch.empty(size, dtype=torch.uint8, device="cpu")
        entries, offset = [], 0
        for name, tensor in pending:
            nbytes = tensor.numel() * tensor.element_size()
            bucket_u8[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            entries.append([name, dtype_name(tensor.dtype), list(tensor.shape), offset])
            offset = align_up(offset + nbytes)
        return bucket_u8, entries

    for name, tensor in weights:
        nbytes = align_up(tensor.numel() * tensor.element_size())
        if pending and size + nbytes > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor.to("cpu")))
        size += nbytes
    if pending:
        yield flush()


class WeightPusher:
    """The trainer's end of one server's pair group. `join` (re)opens it; `push` sends a version."""

    def __init__(
        self, url: str, trainer_address: str, timeout_s: float, backend: str = "gloo", cuda_device: torch.device | None = None,
    ) -> None:
        self.url = url
        self.trainer_address = trainer_address
        self.timeout_s = timeout_s
        self.backend = backend
        # NCCL: the trainer's device, taken on its main thread (a push thread's current CUDA device is 0).
        self.cuda_device = cuda_device
        self.group: Any = None

    def join(self) -> dict[str, Any]:
        """Open the pair group; the server's answer (its model fingerprint, its version)."""
        import torch.distributed as dist

        store = pair_store(self.trainer_address, 0, 0, self.timeout_s)  # bound before its port is named
        spec = {"host": self.trainer_address, "port": store.port, "backend": self.backend, "timeout_s": self.timeout_s}
        answer: dict[str, Any] = {}
        errors: list[BaseException] = []

        def remote() -> None:
            try:
                answer.update(collective_rpc(self.url, "rltrain_join", [json.dumps(spec)], self.timeout_s)[0])
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(exc)

        thread = threading.Thread(target=remote, daemon=True)
        thread.start()
        try:
            self.group = open_pair_group(store, 0, self.backend, self.timeout_s)
            probe = torch.zeros(1, device=self._device())
            self.group.broadcast([probe], dist.BroadcastOptions()).wait()
        except RuntimeError as exc:
            thread.join(self.timeout_s)
            raise ServerDown(f"{self.url} did not join the weight push{self._hint()}: {errors[0] if errors else exc}") from exc
        thread.join(self.timeout_s + 10)
        if errors:
            error = errors[0]
            if self.backend == "nccl" and isinstance(error, ServerDown):
                raise ServerDown(f"{self.url} did not join the weight push{self._hint()}: {error}") from error
            raise error
        return answer

    def _hint(self) -> str:
        return f" over NCCL ({NCCL_HINT})" if self.backend == "nccl" else ""

    def push(self, buckets: list[tuple[torch.Tensor, list[list[Any]]]], version: int, hold_requests: bool = False) -> None:
        """One version into the server; returns once it has loaded it and labels new completions.

        `hold_requests` (in-flight updates, docs/async.md): the server's requests in flight are held
        between two decoding steps (vLLM's `/pause?mode=keep`, their KV cache kept) while the
        version loads and its label is set, then go on under it: every token carries the version
        that sampled it."""
        if not hold_requests:
            self._load(buckets, version)
            return
        call(self.url, "/pause?mode=keep&clear_cache=false", {}, self.timeout_s)
        try:
            self._load(buckets, version)
        finally:
            call(self.url, "/resume", {}, self.timeout_s)

    def _load(self, buckets: list[tuple[torch.Tensor, list[list[Any]]]], version: int) -> None:
        import torch.distributed as dist

        manifest = {"version": version, "buckets": [{"nbytes": int(b.numel()), "entries": e} for b, e in buckets]}
        errors: list[BaseException] = []

        # The load, the cache resets and the label in one request (rollout/server/load_route.py). Requests
        # held in flight keep their blocks, so the prefix-cache reset then fails (answered, not raised):
        # their prompts were salted with the version they entered under (FleetStream).
        def remote() -> None:
            try:
                body = {"manifest": json.dumps(manifest), "version": str(version), "timeout": self.timeout_s}
                call(self.url, LOAD_PATH, body, self.timeout_s + 5)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(exc)

        thread = threading.Thread(target=remote, daemon=True)
        thread.start()
        try:
            for bucket_u8, _ in buckets:
                self.group.broadcast([bucket_u8.to(self._device())], dist.BroadcastOptions()).wait()
        except RuntimeError as exc:
            self.group = None
            raise ServerDown(f"{self.url} failed during a weight push: {errors[0] if errors else exc}") from exc
        thread.join(self.timeout_s + 10)
        if thread.is_alive():
            self.group = None
            raise ServerDown(f"{self.url} did not confirm a weight push within {self.timeout_s:g}s")
        if errors:
            self.group = None
            error = errors[0]
            raise error if isinstance(error, (ServerDown, ServerRefused)) else ServerDown(str(error))

    def _device(self) -> torch.device:
        """Where a bucket is sent from: host memory over gloo, the trainer's GPU over NCCL (each
        push copies the host bucket there; the host copy stays for servers that come back)."""
        if self.backend == "gloo":
            return torch.device("cpu")
        return self.cuda_device or torch.device("cuda", torch.cuda.current_device())
