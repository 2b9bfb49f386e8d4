"""The RolloutEngine protocol: generation, weight updates, sleep/wake, liveness."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingSettings:
    n: int = 1  # completions per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class Completion:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]  # sampling log-probability of each generated token (of the unmodified distribution)
    finished: bool  # stopped at a stop token; False = cut at max_new_tokens


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Completion]:
        """`sampling.n` completions per prompt, prompt-major order."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors under Hugging Face names; resets any prefix cache."""

    def sleep(self) -> None:
        """Release accelerator memory until `wake()`. An engine whose weights do not survive it
        (vLLM at sleep level 2 on CUDA) sets `weights_survive_sleep = False`: time sharing then sends
        the weights again after every wake (an engine without the attribute keeps its weights)."""

    def wake(self) -> None: ...

    def ping(self) -> bool: ...
