"""A pipeline schedule over point-to-point send/recv, for micro-batches of different shapes.

megatron's own schedules exchange activations through CUDA-allocated buffers and expect one
sequence length per step (or an extra shape exchange); here each stage derives every
micro-batch's [T, B, H] from the micro-batch itself (all stages of a pipeline receive the same
data), so ragged micro-batches need no metadata on the wire. The schedule is GPipe-shaped: every
forward in order, then every backward in the same order. Sends are asynchronous so a stage can
compute its next micro-batch while the previous activation is in flight.

With one stage this degenerates to a plain loop of forward (+ backward) per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rltrain.backends.megatron.batching import PaddedMicroBatch
from rltrain.backends.megatron.model import stage_forward


@dataclass
class Pipeline:
    group: dist.ProcessGroup | None
    rank: int
    size: int
    prev: int | None  # global rank of the previous stage
    next: int | None  # global rank of the next stage
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


# on_output(micro-batch index, last-stage logits [B, T, V/tp]) -> loss to backward (train) or None
OnOutput = Callable[[int, torch.Tensor], torch.Tensor | None]


def run_pipeline(
    model: torch.nn.Module, pipe: Pipeline, batches: list[PaddedMicroBatch], on_output: OnOutput, train: bool
) -> None:
    sends: list = []
    saved: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    try:
        with torch.enable_grad() if train else torch.no_grad():
            for i, mb in enumerate(batches):
                input_TBH = None
                if not pipe.first:
                    input_TBH = torch.empty(mb.seq_len, mb.batch_size, pipe.hidden_size, dtype=pipe.dtype, device=pipe.device)
                    dist.recv(input_TBH, src=pipe.prev, group=pipe.group)
                    input_TBH.requires_grad_(train)
                out = stage_forward(model, mb.tokens_BT if pipe.first else None, mb.seq_len, input_TBH)
                if pipe.last:
                    saved.append((input_TBH, on_output(i, out)))
                else:
                    sends.append(dist.isend(out.detach().contiguous(), dst=pipe.next, group=pipe.group))
                    saved.append((input_TBH, out if train else None))
        if not train:
            return
        for i, (input_TBH, out) in enumerate(saved):
            saved[i] = (None, None)  # release the graph of this micro-batch as soon as it is done
            assert out is not None
            if pipe.last:
                out.backward()
            else:
                grad_TBH = torch.empty_like(out)
                dist.recv(grad_TBH, src=pipe.next, group=pipe.group)
                torch.autograd.backward(out, grad_TBH)
            if input_TBH is not None:
                grad_in = input_TBH.grad if input_TBH.grad is not None else torch.zeros_like(input_TBH)
                sends.append(dist.isend(grad_in.contiguous(), dst=pipe.prev, group=pipe.group))
    finally:
        for work in sends:
            work.wait()
