"""A LoRA policy's frozen base as a reference: the same FSDP engine scoring with its adapters
disabled, so a LoRA run needs no second model for its KL term (docs/lora.md)."""

from __future__ import annotations

from typing import Any

from rltrain.backends.base import LogProbScorer, PolicyOutput
from rltrain.data.batch import SequenceBatch


class AdaptersOff:
    """A LoRA engine's frozen base: its log-probabilities with every adapter disabled, which are
    the log-probabilities of the model it started from (the adapters' only difference)."""

    def __init__(self, engine: LogProbScorer, adapters: Any) -> None:
        self.engine, self.adapters = engine, adapters  # adapters: the engine's PEFT model
        self.rank, self.world_size = engine.rank, engine.world_size

    def forward_logps(self, micro_batches: list[SequenceBatch], with_entropy: bool = False) -> list[PolicyOutput]:
        with self.adapters.disable_adapter():
            return self.engine.forward_logps(micro_batches, with_entropy)
