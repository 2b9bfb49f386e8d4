"""A pipeline schedule over point-to-point send/recv, for micro-batches of different shapes.

megatron's own schedules expect one sequence length per step and CUDA buffers; here each stage
derives every shape from the micro-batch itself, and 1F1B bounds activation memory.
docs/internals/backends.md describes the order and the autocast boundaries.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from rltrain.backends.megatron.batching import PaddedMicroBatch
from rltrain.backends.megatron.groups import ParallelCoords
from rltrain.backends.megatron.model import stage_forward
from rltrain.runtime import distributed as p2p
from rltrain.runtime.precision import Precision


@dataclass
class Pipeline:
    group: dist.ProcessGroup | None
    rank: int
    size: int
    prev: int | None  # global rank of the previous stage
    next: int | None  # global rank of the next stage
    hidden_size: int
    dtype: torch.dtype  # of the activations sent between stages
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # around each forward

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


def stage_pipeline(coords: ParallelCoords, hidden_size: int, precision: Precision, device: torch.device) -> Pipeline:
    """This rank's place in its pipeline, read from `coords` (re-read each call: time sharing
    re-creates the groups)."""
    ranks = dist.get_process_group_ranks(coords.pp_group) if coords.pp > 1 else [dist.get_rank()]
    return Pipeline(
        group=coords.pp_group,
        rank=coords.pp_rank,
        size=coords.pp,
        prev=ranks[coords.pp_rank - 1] if coords.pp_rank > 0 else None,
        next=ranks[coords.pp_rank + 1] if coords.pp_rank < coords.pp - 1 else None,
        hidden_size=hidden_size,
        dtype=precision.param_dtype,  # not the first parameter's: norm weights stay fp32 in pure bf16
        device=device,
        autocast=partial(precision.autocast, device),
    )


# on_output(micro-batch index, last-stage output: final hidden states [B, T, H], or a critic's final hidden
# states [T, B, H]) -> loss to backward (train) or None
OnOutput = Callable[[int, torch.Tensor], torch.Tensor | None]
# on_backward(micro-batch index, that loss): runs the last stage's backward of it. The engine's
# hook, so that a failed backward can still be paid for (rltrain.safety.guard) before the schedule
# sends the input gradient to the previous stage.
OnBackward = Callable[[int, torch.Tensor], None]


# before_pass(micro-batch index): runs before that micro-batch's forward and before its backward on
# this stage, for state a forward reads beside its inputs (a MoE's router replay record: recomputed
# activations must see the same one).
BeforePass = Callable[[int], None]


def _plain_backward(i: int, loss: torch.Tensor) -> None:
    loss.backward()


def _nothing(i: int) -> None:
    return None


class _Stage:
    """One stage's forward and backward steps, with the sends they owe kept until the end."""

    def __init__(
        self, model: torch.nn.Module, pipe: Pipeline, on_output: OnOutput, on_backward: OnBackward = _plain_backward,
        before_pass: BeforePass = _nothing,
    ) -> None:
        self.model, self.pipe, self.on_output, self.on_backward = model, pipe, on_output, on_backward
        self.before_pass = before_pass
        self.sends: list = []

    def forward(self, i: int, mb: PaddedMicroBatch, train: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        pipe = self.pipe
        self.before_pass(i)
        input_TBH = None
        if not pipe.first:
            input_TBH = torch.empty(mb.seq_len, mb.batch_size, pipe.hidden_size, dtype=pipe.dtype, device=pipe.device)
            assert pipe.prev is not None  # every stage but the first has a previous one
            p2p.recv(input_TBH, src=pipe.prev, group=pipe.group)
            input_TBH.requires_grad_(train)
        with pipe.autocast():
            out = stage_forward(self.model, mb.tokens_BT if pipe.first else None, mb.seq_len, input_TBH)
        if pipe.last:
            return input_TBH, self.on_output(i, out)
        out = out.to(pipe.dtype)  # the wire's dtype (no-op unless autocast produced another)
        assert pipe.next is not None  # every stage but the last has a next one
        self.sends.append(p2p.isend(out.detach().contiguous(), dst=pipe.next, group=pipe.group))
        return input_TBH, out if train else None

    def backward(self, i: int, input_TBH: torch.Tensor | None, out: torch.Tensor | None) -> None:
        pipe = self.pipe
        assert out is not None
        self.before_pass(i)
        if pipe.last:
            self.on_backward(i, out)
        else:
            grad_TBH = torch.empty_like(out)
            assert pipe.next is not None
            p2p.recv(grad_TBH, src=pipe.next, group=pipe.group)
            torch.autograd.backward(out, grad_TBH)
        if input_TBH is not None:  # not the first stage
            assert pipe.prev is not None
            grad_in = input_TBH.grad if input_TBH.grad is not None else torch.zeros_like(input_TBH)
            self.sends.append(p2p.isend(grad_in.contiguous(), dst=pipe.prev, group=pipe.group))

    def wait(self) -> None:
        for work in self.sends:
            work.wait()
        self.sends.clear()


def run_pipeline(
    model: torch.nn.Module,
    pipe: Pipeline,
    batches: list[PaddedMicroBatch],
    on_output: OnOutput,
    train: bool,
    on_backward: OnBackward = _plain_backward,
    before_pass: BeforePass = _nothing,
) -> None:
    stage = _Stage(model, pipe, on_output, on_backward, before_pass)
    try:
        if not train:
            with torch.no_grad():
                for i, mb in enumerate(batches):
                    stage.forward(i, mb, train=False)
            return
        warmup = min(pipe.size - pipe.rank - 1, len(batches))
        in_flight: deque = deque()
        with torch.enable_grad():
            for i in range(warmup):
                in_flight.append((i, *stage.forward(i, batches[i], train=True)))
            for i in range(warmup, len(batches)):
                in_flight.append((i, *stage.forward(i, batches[i], train=True)))
                stage.backward(*in_flight.popleft())
            while in_flight:
                stage.backward(*in_flight.popleft())
    finally:
        stage.wait()
