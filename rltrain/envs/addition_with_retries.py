"""A built-in multi-turn environment: the built-in addition task with feedback and another try.

`env=python env.cls=rltrain.envs.addition_with_retries:AdditionWithRetries`: the model answers the prompt's sum; a
right answer ends the episode with reward 1, a wrong one gets the observation " wrong, try again:"
and another turn (up to `env.max_turns`), each later success worth less (1 / attempt). It needs the
data's `answer` column (the built-in task has it). Deterministic, as every environment must be for
a rebuilt episode to reach the same state (docs/environments.md).
"""

from __future__ import annotations

from typing import Any

FEEDBACK = " wrong, try again:"


class AdditionWithRetries:
    def reset(self, **row: Any) -> None:
        self.answer = str(row["answer"]).strip()
        self.attempts = 0

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.attempts += 1
        if text.strip() == self.answer:
            return None, 1.0 / self.attempts, True
        return FEEDBACK, 0.0, False
