"""The RolloutEngine protocol: generation, weight updates, sleep/wake, liveness."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from rltrain.rollout.images import PromptImages


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
    # A multi-turn trajectory (rltrain/envs): True where the model sampled the token, False on the
    # environment's observations (their logprob is 0). None: every token was sampled.
    sampled: list[bool] | None = None
    # The prompt these tokens continue where it is not the row's (an agent's call rendered its own
    # messages, rltrain/envs/agent/runner.py). None: the row's prompt.
    prompt_ids: list[int] | None = None
    # The policy version that sampled it, as the server reported it (rollout=server); None for an
    # engine beside the trainer, whose weights are the ones the schedule delivered.
    version: int | None = None
    # The images of the sequence, in placeholder order, where they are not the row's (an episode
    # whose observations or agent messages carried images; rltrain/envs). None: the row's.
    images: list | None = None
    # The experts each MoE layer routed each token to when it was sampled, [tokens, layers, k]
    # int16 (rltrain.models.moe.ROUTING_DTYPE), where the engine records them (rollout=hf on a
    # MoE): what router replay routes the trainer's forwards by (docs/moe.md). None: not recorded.
    routing: torch.Tensor | None = None


class RolloutEngine(Protocol):
    # False where the weights do not survive `sleep()` (vLLM at sleep level 2 on CUDA): time
    # sharing then sends them again after every wake.
    weights_survive_sleep: bool

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSettings, images: list[PromptImages] | None = None
    ) -> list[Completion]:
        """`sampling.n` completions per prompt, prompt-major order. `images`: each prompt's images
        in placeholder order (rollout/images.py has the prompt forms an engine accepts)."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors under Hugging Face names; resets any prefix cache."""

    def sleep(self) -> None:
        """Release accelerator memory until `wake()` (see `weights_survive_sleep`)."""

    def wake(self) -> None: ...

    def ping(self) -> bool:
        """Liveness for `/healthz/deep`, called from the health server's thread while the training
        loop may be using the engine: a real round trip to the engine (its worker, its child
        process, its model), never a flag. True when it answers; False or an exception (the health
        check reports the message) when it does not. It must never wait unboundedly on the engine
        nor harm it: while the training loop is inside the engine (`exclusive` methods), the call in
        progress is the proof of life and ping answers True without entering (a call that wedges
        stalls the step, which the step-progress check reports)."""

    def metrics(self) -> dict[str, float]:
        """The engine's own metrics for the step's row (the server fleet's versions and failures);
        empty for an engine beside the trainer."""

    def close(self) -> None:
        """Release the engine (its memory, its child process) before the process group goes away."""


F = TypeVar("F", bound=Callable[..., Any])


def exclusive(method: F) -> F:
    """Run an engine method holding the engine's `_gate` (a `threading.RLock` made in its
    `__init__`), so that `ping()` from another thread never enters the engine at the same time."""

    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        with self._gate:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
