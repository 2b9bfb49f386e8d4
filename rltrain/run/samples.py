"""What the model wrote: a few (prompt, completion, reward) samples per evaluation, and per GRPO
step every `logger.sample_every` steps, shown in the trackers as tables (`samples/eval`, `samples/train`).

Numbers in metrics.jsonl say *that* a run learns; samples say *what* it learned to write (a
reward hacked by a degenerate completion is obvious in a table and invisible in a mean). An
algorithm records its rank's samples (`Algorithm.samples()` hands them over); rank 0's are logged.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SAMPLES = 16  # rows per table: enough to read, small enough to log often
TABLE_COLUMNS = ("step", "prompt", "completion", "reward")


@dataclass
class Sample:
    prompt: str
    completion: str
    reward: float


def first_samples(prompts: list[str], completions: list[str], rewards: list[float]) -> list[Sample]:
    """The first MAX_SAMPLES of parallel lists as samples."""
    return [Sample(p, c, float(r)) for p, c, r in list(zip(prompts, completions, rewards))[:MAX_SAMPLES]]
