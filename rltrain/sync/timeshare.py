"""Time sharing: the trainer and the rollout engine take turns on the same accelerator.

With `placement.time_sharing=true` a step moves through named phases (offload, wake, sync,
generate, sleep, onload, train), so that the peak memory is the larger of the two, not their sum.
docs/time-sharing-and-sync.md explains the phases, sleep levels and the CPU build;
docs/internals/sync.md has the design (export before teardown, what each phase moves).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from rltrain.backends.base import Communicators, TrainEngine
from rltrain.rollout.base import RolloutEngine
from rltrain.sync.weight_sync import WeightSync

log = logging.getLogger(__name__)

PHASES = ("offload", "wake", "sync", "generate", "sleep", "onload", "train")


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
        log.debug("phase %s: %.3fs", name, seconds)

    def pop(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out


class TimeSharing:
    """Moves a trainer (its engines) and a rollout engine through the phases above.

    engines: the training engines (policy first, then e.g. a reference); each has `groups`
      (`Communicators`, possibly shared between engines, or None) and `offload()`/`onload()`.
    enabled: `placement.time_sharing`. When false, `rollout_turn` only times `generate`.
    weights: the policy's weights on their way to the engine; the `sync` phase delivers them.
    frozen: frozen models on the device (`HostOffloadable`), offloaded after the engines and
      onloaded after them.
    """

    def __init__(
        self,
        engines: Sequence[TrainEngine],
        rollout: RolloutEngine,
        device: torch.device,
        enabled: bool,
        weights: WeightSync,
        frozen: Sequence[HostOffloadable] = (),
    ) -> None:
        self.engines = list(engines)
        self.frozen = list(frozen)
        self.rollout = rollout
        self.enabled = enabled
        self.weights = weights
        self.clock = PhaseClock(device)
        self.last_generate_s = 0.0
        if enabled:
            self.rollout.sleep()  # between turns the trainer holds the accelerator

    def _communicators(self) -> list[Communicators]:
        """Each engine's groups once, in engine order (a policy and its reference may share)."""
        unique: dict[int, Communicators] = {}
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
            self.weights.deliver()
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

    def pop_metrics(self) -> dict[str, float]:
        return self.clock.pop()

