"""An example environment for `env=python`: guess a sum, with "higher" or "lower" after a wrong guess.

    PYTHONPATH=examples python -m rltrain algo=grpo env=python env.cls=higher_lower:HigherLower

It plays on the built-in addition task (it reads the row's `answer` column). A right answer ends the
episode with reward 1 / attempt; a wrong one gets " higher:" or " lower:" (or " a number:" for a reply
that is not one) and another turn. Deterministic, as every environment must be: a worker that lost
the episode rebuilds it by replaying the replies (docs/environments.md).
"""

from __future__ import annotations

from typing import Any


class HigherLower:
    def reset(self, **row: Any) -> None:
        self.answer = int(str(row["answer"]).strip())
        self.attempts = 0
        return None  # no first observation: the prompt is the question

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.attempts += 1
        try:
            guess = int(text.strip())
        except ValueError:
            return " a number:", 0.0, False
        if guess == self.answer:
            return None, 1.0 / self.attempts, True
        return (" higher:" if guess < self.answer else " lower:"), 0.0, False
