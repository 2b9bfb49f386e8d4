"""`backend.compile`: `torch.compile` each decoder layer of the FSDP model, not the whole model.

Identical layers share one compiled graph, so compile time does not grow with depth, and
`dynamic=True` keeps ragged micro-batches from recompiling; parameter names do not change.
docs/internals/backends.md explains the per-layer choice, the bounded recompiles and FSDP hooks.
"""

from __future__ import annotations

from torch import nn


def compile_decoder_layers(decoder_layers: nn.ModuleList) -> int:
    """Compile every decoder layer in place (call before `fully_shard`); returns how many."""
    for layer in decoder_layers:
        layer.compile(dynamic=True)
    return len(decoder_layers)
