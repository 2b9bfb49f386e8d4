"""Fault injection, a testing aid: `debug.fault=KIND:RANK:STEP`.

Each safety behaviour of rltrain is proved by making the failure happen on purpose, on one rank,
at one step, in a real run, and watching the others cope. A run holds its `FaultInjector` in its
`RunContext` and hands it to the engines it builds. The kinds and the STEP syntax:
docs/internals/safety.md; the fault suite: docs/failure-behaviour.md. Never set this in production.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from rltrain.runtime.errors import UserError

KINDS = ("loss_error", "device_error", "backward_error", "nan_grad", "kill", "rollout_dead", "adapter_dropped")


class InjectedFault(RuntimeError):
    """The error `debug.fault` asked for."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    first_step: int
    last_step: int

    def covers(self, rank: int, step: int) -> bool:
        return rank == self.rank and self.first_step <= step <= self.last_step


def parse_faults(spec: str | None) -> list[Fault]:
    """`KIND:RANK:STEP[,KIND:RANK:STEP...]` -> faults; a clear UserError for anything else."""
    if spec is None or not str(spec).strip():
        return []
    faults = []
    for item in str(spec).split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in KINDS:
            raise UserError(
                f"debug.fault={spec!r}: each fault is KIND:RANK:STEP with KIND one of {', '.join(KINDS)} "
                "(e.g. loss_error:1:3 or nan_grad:0:2-4)."
            )
        kind, rank_text, step_text = parts
        try:
            first, _, last = step_text.partition("-")
            fault = Fault(kind, int(rank_text), int(first), int(last or first))
        except ValueError:
            raise UserError(f"debug.fault={spec!r}: RANK and STEP in {item!r} must be integers.") from None
        if fault.rank < 0 or fault.first_step < 1 or fault.last_step < fault.first_step:
            raise UserError(f"debug.fault={spec!r}: {item!r} needs RANK >= 0 and 1 <= FIRST <= LAST steps.")
        faults.append(fault)
    return faults


@dataclass
class FaultInjector:
    """The faults meant for this rank, and the step the trainer is on; with no faults (the default)
    it injects nothing."""

    faults: list[Fault] = field(default_factory=list)
    rank: int = 0
    step: int = 0
    _fired: set[tuple[str, int]] = field(default_factory=set)

    def set_step(self, step: int) -> None:
        self.step = step

    def due(self, kind: str) -> bool:
        """True once per step when a fault of `kind` covers this rank and step."""
        if (kind, self.step) in self._fired:
            return False
        if any(f.kind == kind and f.covers(self.rank, self.step) for f in self.faults):
            self._fired.add((kind, self.step))
            return True
        return False

    def maybe_raise(self, kind: str) -> None:
        if self.due(kind):
            raise InjectedFault(f"{kind} injected by debug.fault on rank {self.rank} at step {self.step}")

    def in_loss(self) -> None:
        """The faults of the loss function: `loss_error` (an ordinary error, recoverable) and
        `device_error` (the message torch gives a CPU tensor meeting a CUDA one: a bug, which the
        guard re-raises in both modes)."""
        self.maybe_raise("loss_error")
        if self.due("device_error"):
            raise InjectedFault(
                "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
                f"cpu! (device_error injected by debug.fault on rank {self.rank} at step {self.step})"
            )

    def arm_backward(self, loss: torch.Tensor) -> None:
        """Make `loss.backward()` raise from inside autograd, before any model gradient exists."""
        if loss.requires_grad and self.due("backward_error"):
            message = f"backward_error injected by debug.fault on rank {self.rank} at step {self.step}"

            def explode(grad: torch.Tensor) -> torch.Tensor:
                raise InjectedFault(message)

            loss.register_hook(explode)

    def poison_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Turn one local gradient into NaN (a local shard under FSDP2)."""
        if not self.due("nan_grad"):
            return
        for p in params:
            if p.grad is not None:
                with torch.no_grad():
                    p.grad.fill_(float("nan"))
                return

    def maybe_kill(self) -> None:
        if self.due("kill"):
            os.kill(os.getpid(), signal.SIGKILL)

    def rollout_dead(self) -> bool:
        return any(f.kind == "rollout_dead" and f.rank == self.rank and self.step >= f.first_step for f in self.faults)

    def adapters_dropped(self) -> bool:
        """`adapter_dropped`: from its step on, this rank's weight export leaves the LoRA adapters
        out (the engine samples from the base), a broken sync the parity check must catch."""
        return any(f.kind == "adapter_dropped" and f.rank == self.rank and self.step >= f.first_step for f in self.faults)

    def wrap_ping(self, ping: Callable[[], object] | None) -> Callable[[], object] | None:
        """The rollout engine's ping, failing once `rollout_dead` applies. With no engine and a
        `rollout_dead` fault, a stand-in engine that answers until then (so the fault is testable
        before any algorithm has a rollout engine)."""
        if not any(f.kind == "rollout_dead" and f.rank == self.rank for f in self.faults):
            return ping

        def faulty_ping() -> object:
            if self.rollout_dead():
                raise InjectedFault(f"rollout engine dead (debug.fault rollout_dead since step {self.step})")
            return ping() if ping is not None else True

        return faulty_ping

