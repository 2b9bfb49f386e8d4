"""Forward, loss and backward of one micro-batch, guarded so that no rank is left alone in a collective.

Under FSDP2, DDP and Megatron's pipeline the backward is itself a sequence of collectives, so a
rank whose loss raised must still run a zero backward built from the model's outputs, or its peers
hang. An explicit per-micro-batch state (`Phase`) says whether that backward is still owed. The
phases and why a detached zero is wrong: docs/internals/safety.md; which errors are recovered at
all: rltrain/safety/error_kinds.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from rltrain.safety.error_kinds import is_collective_failure, is_programming_error

Out = TypeVar("Out")


class Phase(enum.Enum):
    START = "start"
    FORWARD = "forward"
    OUTPUTS = "outputs"
    LOSS = "loss"
    BACKWARD = "backward"
    MODEL_BACKWARD = "model_backward"
    DONE = "done"


class Owed(enum.Enum):
    """What a failed micro-batch still owes its peers."""

    NOTHING = "nothing"
    ZERO_BACKWARD = "zero backward from the outputs"
    DUMMY_FORWARD_AND_ZERO_BACKWARD = "forward on a dummy batch, then a zero backward from its outputs"


class UnrecoverableStepError(RuntimeError):
    """An error at a point where this rank's collectives can no longer be matched with its peers'."""


class TooManyErrors(RuntimeError):
    """More consecutive steps with errors than `safety.max_consecutive_errors` allows."""


def fail_fast_enabled(configured: bool) -> bool:
    """`RLTRAIN_FAIL_FAST` (1/true/yes or 0/false/no) overrides `safety.fail_fast`, so a developer can
    flip the mode of any run, torchrun-launched ones included, without touching its config."""
    value = os.environ.get("RLTRAIN_FAIL_FAST", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return configured


# --- models and outputs ----------------------------------------------------------------------


def model_chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """A model, or the chunks of a virtual-pipeline model, as a list."""
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        return [model]
    return list(model)


def trainable_parameters(model: nn.Module | Sequence[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable parameter of every chunk; names are `chunk<i>.<name>`
    when there is more than one chunk."""
    chunks = model_chunks(model)
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                yield (f"chunk{i}.{name}" if len(chunks) > 1 else name), p


def params_without_grad(model: nn.Module | Sequence[nn.Module]) -> list[str]:
    """Trainable parameters that received no gradient: after a correct zero backward, none."""
    return [name for name, p in trainable_parameters(model) if p.grad is None]


def output_tensors(outputs: Any) -> list[torch.Tensor]:
    """Every tensor with a graph in a nested structure of outputs (tensors, tuples, lists, dicts,
    dataclasses such as PolicyOutput or transformers' ModelOutput)."""
    found: list[torch.Tensor] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                found.append(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, list | tuple):
            for value in obj:
                walk(value)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(outputs)
    return found


def zero_loss_from_outputs(outputs: Any) -> torch.Tensor:
    """A scalar zero that depends on every output tensor, hence on every parameter that produced
    them. Its backward sends exact zeros (d(0*x)/dx = 0), so it fires every hook and collective and
    changes no gradient. An empty output tensor still works: its `sum()` keeps the graph."""
    tensors = output_tensors(outputs)
    if not tensors:
        raise UnrecoverableStepError(
            "no output tensor with a graph to build a zero loss from (forward ran without gradients?)"
        )
    zero = tensors[0].float().sum() * 0.0
    for t in tensors[1:]:
        zero = zero + t.float().sum() * 0.0
    return zero


# --- the per-micro-batch state -----------------------------------------------------------------


class MicroBatchGuard:
    """The explicit state of one micro-batch. Drive it with `entered()` (or `track()`),
    `record_outputs()`, `record_loss()`, `backward()`; after an error ask `owed()`."""

    def __init__(self, model: nn.Module | Sequence[nn.Module] | None = None) -> None:
        self.phase = Phase.START
        self.outputs: list[torch.Tensor] = []
        self._chunks = model_chunks(model) if model is not None else []
        self._handles: list[Any] = []

    def _advance(self, phase: Phase) -> None:
        # Hooks may fire again (the zero backward also reaches the outputs); never move backwards.
        order = list(Phase)
        if order.index(phase) > order.index(self.phase):
            self.phase = phase

    def entered(self) -> None:
        """The model's forward began (its first collective may follow at once)."""
        self._advance(Phase.FORWARD)

    @contextlib.contextmanager
    def track(self) -> Iterator[MicroBatchGuard]:
        """Mark FORWARD from inside every chunk's forward, before anything else (FSDP's all-gather
        included) runs there; remove every hook afterwards."""
        handles = [chunk.register_forward_pre_hook(lambda *_: self.entered(), prepend=True) for chunk in self._chunks]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def record_outputs(self, outputs: Any) -> None:
        """The forward returned; a gradient reaching any of these tensors means the model's own
        backward has begun."""
        self.outputs = output_tensors(outputs)
        for t in self.outputs:
            if t.grad_fn is not None:
                self._handles.append(t.register_hook(self._on_output_grad))
        self._advance(Phase.OUTPUTS)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._advance(Phase.MODEL_BACKWARD)

    def record_loss(self, loss: torch.Tensor) -> None:
        self._advance(Phase.LOSS)

    def backward(self, loss: torch.Tensor) -> None:
        self._advance(Phase.BACKWARD)
        loss.backward()
        self._advance(Phase.DONE)

    def owed(self) -> Owed:
        """What this micro-batch still owes its peers after an error; raises if it cannot pay."""
        if self.phase is Phase.DONE:
            return Owed.NOTHING
        if self.phase is Phase.START:
            return Owed.DUMMY_FORWARD_AND_ZERO_BACKWARD
        if self.phase in (Phase.OUTPUTS, Phase.LOSS, Phase.BACKWARD):
            return Owed.ZERO_BACKWARD
        where = "inside the model's forward" if self.phase is Phase.FORWARD else "inside the model's backward"
        raise UnrecoverableStepError(
            f"the error happened {where}, after this rank's collectives for the micro-batch had begun; "
            "its peers cannot be realigned, so the run stops"
        )

    def zero_backward(self) -> None:
        """Backward of a zero built from the recorded outputs (their graph has not run)."""
        self._advance(Phase.BACKWARD)
        zero_loss_from_outputs(self.outputs).backward()
        self._advance(Phase.DONE)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.outputs = []


# --- the policy: recover or fail fast ----------------------------------------------------------


@dataclasses.dataclass
class StepErrors:
    """The errors of one optimizer step on this rank, and what to do about them."""

    rank: int
    fail_fast: bool
    recovered: int = 0

    def handle(self, exc: Exception, guard: MicroBatchGuard, where: str, dummy_outputs: Callable[[], Any]) -> None:
        """Re-raise (fail-fast, lost peer, a bug in the program, unrecoverable point) or pay what
        the micro-batch owes, at once. The traceback is printed once, with the rank."""
        owed = self.excuse(exc, guard, where)
        if owed is Owed.DUMMY_FORWARD_AND_ZERO_BACKWARD:
            guard.record_outputs(dummy_outputs())
            guard.zero_backward()
        elif owed is Owed.ZERO_BACKWARD:
            guard.zero_backward()

    def excuse(self, exc: Exception, guard: MicroBatchGuard, where: str) -> Owed:
        """`handle` without the payment: re-raise, or log, count and return what is owed. For a
        caller whose schedule decides *when* the zero backward runs (a pipeline stage runs its
        backward where 1F1B puts it, not where the loss failed)."""
        bug = is_programming_error(exc)
        if self.fail_fast or bug or is_collective_failure(exc):
            exc.add_note(f"rltrain: raised on rank {self.rank} ({where}, phase {guard.phase.value})")
            if bug and not self.fail_fast:
                exc.add_note(
                    "rltrain: not recovered (safety.fail_fast=false): a device, dtype or shape mismatch or a "
                    "Python type/name error is a bug in the program that every step would repeat; see "
                    "docs/failure-behaviour.md"
                )
            raise exc
        try:
            owed = guard.owed()
        except UnrecoverableStepError as fatal:
            raise UnrecoverableStepError(f"rank {self.rank}, {where}: {fatal}") from exc
        detail = "".join(traceback.format_exception(exc)).rstrip()
        print(
            f"rltrain: rank {self.rank}: recovered from an error in {where} (phase {guard.phase.value}); "
            f"owed: {owed.value}\n{detail}",
            file=sys.stderr,
            flush=True,
        )
        self.recovered += 1
        return owed


def guarded_micro_batch(
    guard: MicroBatchGuard,
    errors: StepErrors,
    forward: Callable[[], Out],
    loss_fn: Callable[[Out], tuple[torch.Tensor, Mapping[str, Any]]],
    dummy_forward: Callable[[], Out],
    before_backward: Callable[[torch.Tensor], None] | None = None,
    where: str = "micro-batch",
) -> tuple[torch.Tensor, Mapping[str, Any]] | None:
    """forward -> loss -> backward for one micro-batch. Returns (loss, metrics), or None when the
    micro-batch failed and was paid for with a zero backward (its metrics are lost)."""
    try:
        with guard.track():
            out = forward()
        guard.record_outputs(out)
        loss, metrics = loss_fn(out)
        guard.record_loss(loss)
        if before_backward is not None:
            before_backward(loss)
        guard.backward(loss)
        return loss, metrics
    except Exception as exc:  # noqa: BLE001 - StepErrors decides: re-raise or recover
        errors.handle(exc, guard, where, lambda: _forward_tracked(guard, dummy_forward))
        return None
    finally:
        guard.close()


def _forward_tracked(guard: MicroBatchGuard, forward: Callable[[], Out]) -> Out:
    with guard.track():
        return forward()


@dataclasses.dataclass
class ErrorBudget:
    """Counts consecutive steps in which any rank recovered an error. Fed the *all-reduced* count,
    so every rank reaches the same verdict at the same step and all stop together."""

    max_consecutive: int
    consecutive: int = 0

    def update(self, recovered_all_ranks: float) -> None:
        self.consecutive = self.consecutive + 1 if recovered_all_ranks > 0 else 0
        if self.consecutive > self.max_consecutive:
            raise TooManyErrors(
                f"{self.consecutive} consecutive steps had errors (safety.max_consecutive_errors="
                f"{self.max_consecutive}); the run stops instead of training on partial batches"
            )
