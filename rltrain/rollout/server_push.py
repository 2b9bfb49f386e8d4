"""The weight push to one vLLM API server: a two-member torch.distributed group (gloo on CPU, NCCL
on GPU) opened through the server's `/collective_rpc`, then per version a JSON manifest (names,
dtypes, shapes, offsets: never pickle) and the buckets' raw bytes as broadcasts, and finally the
server's prefix-cache reset and its vLLM weight version, which every completion then reports.
The worker's end is rltrain/rollout/server_worker.py; docs/rollout-servers.md.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rltrain.rollout.server_http import ServerDown, ServerRefused, call, collective_rpc
from rltrain.rollout.server_process import free_port
from rltrain.rollout.server_worker import open_pair_group
from rltrain.transport.layout import align_up, dtype_name

Weights = Iterable[tuple[str, torch.Tensor]]


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

    def __init__(self, url: str, trainer_address: str, timeout_s: float, backend: str = "gloo") -> None:
        self.url = url
        self.trainer_address = trainer_address
        self.timeout_s = timeout_s
        self.backend = backend
        self.group: Any = None

    def join(self) -> dict[str, Any]:
        """Open the pair group; the server's answer (its model fingerprint, its version)."""
        import torch.distributed as dist

        port = free_port(self.trainer_address)
        spec = {"host": self.trainer_address, "port": port, "backend": self.backend, "timeout_s": self.timeout_s}
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
            self.group = open_pair_group(self.trainer_address, port, 0, self.backend, self.timeout_s)
            probe = torch.zeros(1, device=self._device())
            self.group.broadcast([probe], dist.BroadcastOptions()).wait()
        except RuntimeError as exc:
            thread.join(self.timeout_s)
            raise ServerDown(f"{self.url} did not join the weight push: {errors[0] if errors else exc}") from exc
        thread.join(self.timeout_s + 10)
        if errors:
            raise errors[0]
        return answer

    def push(self, buckets: list[tuple[torch.Tensor, list[list[Any]]]], version: int) -> None:
        """One version into the server; returns once it has loaded it and labels new completions."""
        import torch.distributed as dist

        manifest = {"version": version, "buckets": [{"nbytes": int(b.numel()), "entries": e} for b, e in buckets]}
        errors: list[BaseException] = []

        def remote() -> None:
            try:
                collective_rpc(self.url, "rltrain_receive", [json.dumps(manifest)], self.timeout_s)
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
        call(self.url, "/reset_prefix_cache", {}, self.timeout_s)
        call(self.url, "/update_weight_version", {"new_version": str(version)}, self.timeout_s)

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
