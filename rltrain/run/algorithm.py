"""What the loop needs from an algorithm: the protocol every algorithm meets (rltrain.algos implements it).

An algorithm owns its data stream, builds the engines it needs through the lazy registries (never
by importing a backend), and turns one call of `train_step` into exactly one optimizer step of the
policy. Its resumable state (data position, counters) is JSON. The loop knows algorithms by name
only (rltrain.run.trainer), so this protocol lives beside it, below rltrain.algos.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rltrain.run.samples import Sample


class Algorithm(Protocol):
    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step. Returns metrics identical on every rank (already reduced)."""

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics (`eval/...`), identical on every rank."""

    def samples(self) -> list[Sample]:
        """The samples (prompt, completion, reward) this rank recorded since the last call, cleared
        by the call; the trainer logs rank 0's after each step and each evaluation."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def checkpoint_engines(self) -> dict[str, Any]:
        """Engines whose state goes into checkpoints, by name (e.g. {"policy": engine})."""

    def export_engine(self) -> Any:
        """The engine whose weights become the run's `final/` model."""

    def health_ping(self) -> Callable[[], bool] | None:
        """The rollout engine's liveness check for `/healthz/deep` (None: no rollout engine)."""

    def close(self) -> None:
        """Release what the algorithm holds outside the trainer (a rollout engine) before the
        process group goes away."""
