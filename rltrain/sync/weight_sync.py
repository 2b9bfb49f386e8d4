"""When the policy's weights move: published after the update, delivered before generation.

The export is a collective, so it must run while the trainer's process groups live; the engine may
be asleep then, so with time sharing the export is kept as one host copy until the engine's next
turn. With a rollout worker (placement.max_staleness >= 1) the host copy is queued behind the
generations already submitted, so each batch is sampled by the version its schedule says.
docs/time-sharing-and-sync.md has the whole story, docs/internals/sync.md the design.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from rltrain.rollout.ahead import RolloutWorker
from rltrain.rollout.base import RolloutEngine

Weights = Iterable[tuple[str, torch.Tensor]]


class WeightSync:
    """The policy's weights on their way to one rollout engine. `deferred`: time sharing (publish
    keeps a host copy that `deliver` hands over at the engine's next turn). `worker`: the engine
    runs beside the trainer (publish queues a host copy on the engine's worker thread)."""

    def __init__(self, rollout: RolloutEngine, deferred: bool, worker: RolloutWorker | None = None) -> None:
        self.rollout = rollout
        self.deferred = deferred
        self.worker = worker
        self.pending: list[tuple[str, torch.Tensor]] | None = None  # published, not yet delivered
        # An engine that loses its weights in its sleep needs them again after every wake: the last
        # delivered host copy is kept until the next publish replaces it.
        self.resend_after_wake = deferred and not rollout.weights_survive_sleep
        self.delivered: list[tuple[str, torch.Tensor]] | None = None
        self.last_publish_s = 0.0  # the export (and, not deferred, the delivery with it)
        self.last_sync_s = 0.0  # the delivery into the engine
        self.last_bytes = 0  # bytes of the last publish (what one sync moves: `sync/bytes`)

    def publish(self, export: Callable[[], Weights]) -> None:
        """New trainer weights (a collective: every rank). Deferred: a host copy for `deliver`;
        otherwise streamed into the engine now."""
        started = time.perf_counter()
        self.last_bytes = 0
        if self.worker is not None:  # one host copy per version in flight
            copy = [(name, _host_copy(tensor)) for name, tensor in self._counted(export())]
            self.worker.submit(self._load, copy)
            self.last_publish_s = time.perf_counter() - started
            return
        if not self.deferred:
            self.rollout.update_weights(self._counted(export()))
            self.last_sync_s = self.last_publish_s = time.perf_counter() - started
            return
        self.delivered = None  # superseded: never hold two host copies
        self.pending = [(name, _host_copy(tensor)) for name, tensor in self._counted(export())]
        self.last_publish_s = time.perf_counter() - started

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """On the worker thread: one queued version into the engine (`time/sync`)."""
        started = time.perf_counter()
        self.rollout.update_weights(weights)
        self.last_sync_s = time.perf_counter() - started

    def _counted(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            self.last_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def deliver(self) -> None:
        """The weights published since the engine's last turn; for an engine that dropped its
        weights in its sleep, the last ones again (before any publish such an engine restores its
        own checkpoint). Called with the engine awake."""
        started = time.perf_counter()
        weights, self.pending = self.pending, None
        if weights is None and self.resend_after_wake:
            weights = self.delivered
        if weights is not None:
            self.rollout.update_weights(weights)
            if self.resend_after_wake:
                self.delivered = weights
        self.last_sync_s = time.perf_counter() - started


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that shares no storage with a parameter (an export may return views of the
    live parameters, which offload moves and the next optimizer step overwrites)."""
    tensor = tensor.detach()
    if tensor.device.type == "cuda":  # pinned, so the delivery's host-to-device copies are fast
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)
    return tensor.clone()
