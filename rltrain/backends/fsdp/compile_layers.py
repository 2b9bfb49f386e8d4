"""`backend.compile`: `torch.compile` each decoder layer of the FSDP backend's model (torchtitan's
recipe), not the whole model.

Why per layer: the decoder layers are the compute and they are identical in structure, so one
compiled graph serves all of them (dynamo treats a module's parameters as inputs and guards on its
type, not its identity) and compile time does not grow with depth. What lies around the layers
stays eager: the scorer's packing, the selection of completion positions and the chunked output
head, whose shapes depend on the data. Each layer keeps its own FSDP2 unit: `fully_shard` is
applied after compiling, and FSDP's hooks run eagerly around the compiled graph (dynamo skips
them), as in torchtitan.

Why `dynamic=True`: micro-batches are ragged, so nearly every call brings a new `[B, T]`. Compiled
with symbolic sizes from the first call, a new length reuses the graph. The variants that still
compile a graph of their own are few and fixed, so recompiles are bounded: a batch of one row
(dynamo specialises sizes 0 and 1), with or without an attention mask (packed shared-prompt rows
carry one, plain rectangles do not), and a training pass against a scoring pass (grad mode,
train/eval), at most eight, dynamo's default `recompile_limit`.

`Module.compile()` compiles the module's call in place instead of wrapping the module, so
parameter names, and with them checkpoints, the weight export and the saved model, do not change.
Activation checkpointing composes: transformers' `GradientCheckpointingLayer.__call__` wraps the
(compiled) module call in non-reentrant `torch.utils.checkpoint`, and the backward replays it.
"""

from __future__ import annotations

from torch import nn


def compile_decoder_layers(decoder_layers: nn.ModuleList) -> int:
    """Compile every decoder layer in place (call before `fully_shard`); returns how many."""
    for layer in decoder_layers:
        layer.compile(dynamic=True)
    return len(decoder_layers)
