"""What the built-in algorithms share to meet the loop's `Algorithm` protocol (rltrain.run.algorithm):
one trainable policy engine and one resumable stream of examples. What an algorithm gets from the
run, `RunContext`, is in rltrain.config.run_context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rltrain.run.samples import Sample


class PolicyStreamAlgorithm:
    """Plumbing the built-in algorithms share: one trainable `policy` engine, checkpointed and
    exported, one resumable `stream` of example indices as the algorithm's whole state, and the
    samples recorded for the W&B tables (`recorded`, handed over once by `samples()`)."""

    policy: Any
    stream: Any  # rltrain.data.sampler.IndexStream
    recorded: list[Sample]

    def samples(self) -> list[Sample]:
        taken, self.recorded = self.recorded, []
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])

    def checkpoint_engines(self) -> dict[str, Any]:
        return {"policy": self.policy}

    def export_engine(self) -> Any:
        return self.policy

    def health_ping(self) -> Callable[[], bool] | None:
        return None

    def close(self) -> None:
        """Nothing outside the trainer to release."""
