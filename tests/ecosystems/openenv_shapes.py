"""Action and Observation shapes of OpenEnv's own types for tests/unit/envs/test_openenv.py: an
environment whose `step` has no annotation (its Action comes from `Environment[Action, ...]`), and an
Action without a text field. A module of its own so that collecting the tests imports no openenv."""

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class Move(Action):
    x: int
    y: int


class Board(Observation):
    cells: list[int]
    note: str


class Unannotated(Environment[Move, Board, State]):
    def reset(self, seed=None, episode_id=None):
        return Board(cells=[0], note="go")

    def step(self, action, timeout_s=None, **kwargs):
        return Board(cells=[action.x], note="ok", reward=None, done=True)

    @property
    def state(self):
        return State()
