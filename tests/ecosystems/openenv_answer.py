"""An OpenEnv environment written against openenv-core's own API (Environment, Action, Observation,
State), for the `env=openenv` tests: the model answers the row's question; a wrong answer gets
" again:" and another try, the right one reward 1 and the end. A row's `fault` column makes it fail
on purpose: `raise` (step raises), `hang` (step never returns), `garbage` (step returns a string).
`python -m uvicorn openenv_answer:app` serves it (OpenEnv's create_app)."""

from __future__ import annotations

import time
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class AnswerAction(Action):
    text: str


class AnswerObservation(Observation):
    message: str


class AnswerEnvironment(Environment[AnswerAction, AnswerObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.answer, self.fault = "", ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, answer: str = "", fault: str = "",
              **kwargs: Any) -> AnswerObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.answer, self.fault = str(answer), str(fault or "")
        return AnswerObservation(message=" answer:")

    def step(self, action: AnswerAction, timeout_s: float | None = None, **kwargs: Any) -> AnswerObservation:
        self._state.step_count += 1
        if self.fault == "raise":
            raise RuntimeError("this environment fails on purpose")
        if self.fault == "hang":
            time.sleep(100000)
        if self.fault == "garbage":
            return "not an observation"  # type: ignore[return-value]
        right = action.text.strip() == self.answer
        return AnswerObservation(message=" again:", reward=1.0 if right else 0.1 * self._state.step_count, done=right)

    @property
    def state(self) -> State:
        return self._state


app = create_app(AnswerEnvironment, AnswerAction, AnswerObservation, max_concurrent_envs=64)
