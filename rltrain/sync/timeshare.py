"""Time sharing: the trainer and the rollout engine take turns on the same accelerator.

With `placement.time_sharing=true` every GRPO step moves through named phases (DESIGN
invariant 4), each timed as `time/phase/<name>` and followed by a memory sample `mem/<name>`
(MiB: resident set size on CPU; on GPU the device memory in use as the driver reports it, plus
`mem/<name>/allocated` from torch's allocator):

    offload   drop gradients, move parameters and optimizer state to the host, tear down the
              trainer's process groups (every engine's, each shared set once); frozen models
              that only sit on the device (a reward model) move to the host too; on GPU the
              freed memory goes back to the driver (`torch.cuda.empty_cache`), where the rollout
              engine allocates
    wake      the rollout engine takes its memory back
    sync      the weights exported after the last train phase go into the engine
    generate  rollouts
    sleep     the engine releases its memory (vLLM sleep mode; see below for the CPU build)
    onload    re-create the process groups (identical, warmed up, handles re-bound), reload
              (the frozen models too: rewards are scored after the turn, on the device)
    train     scoring, the optimizer step(s), then the weight export for the next sync

This is the cycle train -> offload -> wake -> sync -> generate -> sleep -> onload, entered at
`offload`: a step begins and ends with the trainer holding the accelerator, so checkpointing,
evaluation and the final export need no special case (evaluation takes a turn of its own).

Export before teardown. The full tensors are gathered by a collective on the trainer's groups
(FSDP's `full_tensor`, Megatron's TP/PP gathers), so they must be exported while the groups
live. We export into host memory at the end of the train phase (`publish`), and the sync phase
streams that host copy into the engine. The alternative, streaming straight into the engine
before teardown, would need the engine awake while the trainer still holds its memory: the
peak would be the sum of both, which is what time sharing exists to avoid. The cost is one
host-memory copy of the model between the train and sync phases.

Sleep level 2 (`rollout.sleep_level=2`, vLLM on CUDA) discards the engine's weights instead of
keeping a host copy of them: the sync phase then sends the last weights again after every wake
(evaluation turns included), from a host copy kept here until the next export replaces it, so at
most one host copy exists at a time.

The CPU build of vLLM has no sleep mode: `sleep()`/`wake()` only record the phase (so a
phase-order bug still raises on CPU), and the KV cache and weights stay allocated; offload has
nowhere to move tensors on CPU, so it frees gradients only. The phases, their order, the
teardown and re-creation of process groups, and their timings are all real on CPU; `mem/*`
shows RSS, which does not drop there. With `time_sharing=false` the same object runs the plain
order: generate, train, then sync right away (streaming the export into the engine).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

PHASES = ("offload", "wake", "sync", "generate", "sleep", "onload", "train")
Weights = Iterable[tuple[str, torch.Tensor]]


def resident_mib() -> float:
    """This process's resident set size (VmRSS) in MiB; peak RSS where /proc is missing."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_sample(device: torch.device) -> dict[str, float]:
    """`{"": MiB in use}` (+ `"/allocated"` on GPU): the driver's view of the device, since the
    rollout engine's memory does not go through torch's allocator."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"": (total - free) / 2**20, "/allocated": torch.cuda.memory_allocated(device) / 2**20}
    return {"": resident_mib()}


def release_cached_memory(device: torch.device) -> None:
    """Return the device memory the offloaded tensors held to the driver (GPU). torch's caching
    allocator keeps freed blocks reserved for torch, and the rollout engine allocates from the
    driver (vLLM's sleep-mode allocator), so without this the offload would free nothing it can use."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class HostOffloadable(Protocol):
    """A frozen model held on the training device outside the training engines (a reward model):
    it gives the device up for the rollout engine's turn and takes it back after."""

    def offload(self) -> None: ...

    def onload(self) -> None: ...


class PhaseClock:
    """Accumulates `time/phase/<name>` and the latest `mem/<name>` until `pop()`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.metrics: dict[str, float] = {}
        self.order: list[str] = []  # names in the order they ran since the last pop (for tests)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        key = f"time/phase/{name}"
        self.metrics[key] = self.metrics.get(key, 0.0) + seconds
        for suffix, mib in memory_sample(self.device).items():
            self.metrics[f"mem/{name}{suffix}"] = mib
        self.order.append(name)
        log.debug("phase %s: %.3fs", name, seconds)

    def pop(self) -> dict[str, float]:
        out, self.metrics, self.order = self.metrics, {}, []
        return out


class TimeSharing:
    """Moves a trainer (its engines) and a rollout engine through the phases above.

    engines: the training engines (policy first, then e.g. a reference); each may expose
      `groups` (communicators with `teardown()`/`recreate()`, possibly shared between engines)
      and `offload()`/`onload()`.
    enabled: `placement.time_sharing`. When false, `rollout_turn` only times `generate`, and
      `publish` syncs at once.
    frozen: frozen models on the device (`HostOffloadable`), offloaded after the engines and
      onloaded after them.
    """

    def __init__(
        self, engines: list[Any], rollout: Any, device: torch.device, enabled: bool, frozen: Sequence[HostOffloadable] = ()
    ) -> None:
        self.engines = engines
        self.frozen = list(frozen)
        self.rollout = rollout
        self.enabled = enabled
        self.clock = PhaseClock(device)
        self.pending: list[tuple[str, torch.Tensor]] | None = None  # exported, not yet synced
        # An engine that loses its weights in its sleep (vLLM at rollout.sleep_level=2 on CUDA)
        # needs them again after every wake: the last synced host copy is kept until the next export.
        self.resend_after_wake = enabled and not rollout.weights_survive_sleep
        self.synced: list[tuple[str, torch.Tensor]] | None = None
        self.last_sync_s = 0.0
        self.last_generate_s = 0.0
        if enabled:
            self.rollout.sleep()  # between turns the trainer holds the accelerator

    def _communicators(self) -> list[Any]:
        """Each engine's groups once, in engine order (a policy and its reference may share)."""
        unique: dict[int, Any] = {}
        for engine in self.engines:
            if engine.groups is not None:
                unique.setdefault(id(engine.groups), engine.groups)
        return list(unique.values())

    @contextmanager
    def rollout_turn(self) -> Iterator[None]:
        """The rollout engine's turn; the body generates (timed as `generate`)."""
        if not self.enabled:
            with self._generate_phase():
                yield
            return
        with self.clock.phase("offload"):
            for engine in self.engines:
                engine.offload()
            for groups in self._communicators():
                groups.teardown()
            for model in self.frozen:
                model.offload()
            release_cached_memory(self.clock.device)
        with self.clock.phase("wake"):
            self.rollout.wake()
        with self.clock.phase("sync"):
            self._sync_pending()
        with self._generate_phase():
            yield
        with self.clock.phase("sleep"):
            self.rollout.sleep()
        with self.clock.phase("onload"):
            for groups in self._communicators():
                groups.recreate()
            for engine in self.engines:
                engine.onload()
            for model in self.frozen:
                model.onload()

    @contextmanager
    def _generate_phase(self) -> Iterator[None]:
        started = time.perf_counter()
        with self.clock.phase("generate"):
            yield
        self.last_generate_s = time.perf_counter() - started

    @contextmanager
    def train(self) -> Iterator[None]:
        with self.clock.phase("train"):
            yield

    def publish(self, export: Callable[[], Weights]) -> None:
        """New trainer weights. Time sharing: export them into host memory now, while the
        process groups live (a collective), for the next turn's sync phase. Otherwise: stream
        them into the engine now."""
        if not self.enabled:
            started = time.perf_counter()
            self.rollout.update_weights(export())
            self.last_sync_s = time.perf_counter() - started
            return
        self.synced = None  # superseded: never hold two host copies
        self.pending = [(name, _host_copy(tensor)) for name, tensor in export()]

    def _sync_pending(self) -> None:
        """The weights exported since the last turn; for an engine that dropped its weights in its
        sleep, the last ones again (before any export such an engine restores its own checkpoint)."""
        started = time.perf_counter()
        weights, self.pending = self.pending, None
        if weights is None and self.resend_after_wake:
            weights = self.synced
        if weights is not None:
            self.rollout.update_weights(weights)
            if self.resend_after_wake:
                self.synced = weights
        self.last_sync_s = time.perf_counter() - started

    def pop_metrics(self) -> dict[str, float]:
        return self.clock.pop()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that shares no storage with a parameter (an export may return views of the
    live parameters, which offload moves and the next optimizer step overwrites)."""
    tensor = tensor.detach()
    if tensor.device.type == "cuda":  # pinned, so the sync's host-to-device copies are fast
        return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)
    return tensor.clone()
