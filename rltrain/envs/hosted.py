"""The worker side of an episode: the user's environment objects live in a call worker
(rltrain/runtime/call_pool.py), one per episode, and `advance` is the only function the trainer calls.

A call names the episode and carries *every* action so far, so a worker that does not hold the
episode (a fresh one that replaced a worker killed for a hung step, or another worker of the pool)
rebuilds it: a new instance, `reset(**row)`, then the earlier actions replayed. A worker that holds
it applies only the newest action. This is what lets a worker holding a hung step be killed without
losing the other episodes, and it asks one thing of an environment: the same actions from the same row reach the same state
(docs/environments.md, "Timeouts and rebuilt episodes"). Calls of different episodes run at once,
in threads (`env.max_concurrency`); one episode's calls never overlap. Images: rltrain/envs/wire.py.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from rltrain.envs.wire import from_wire, to_wire

# episode key -> (environment, number of actions it has applied). Keys are "phase:index"; a call from
# another phase (the next step, an evaluation) drops the episodes of the last one (an episode cut at
# max_turns never says it is done).
_LIVE: dict[str, tuple[Any, int]] = {}
_PHASE: list[str] = [""]
_PHASE_LOCK = threading.Lock()


def _environment_class(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _result(value: Any) -> dict[str, Any]:
    """A step's `(observation, reward, done)` as a plain message; anything else is the user's error."""
    if not (isinstance(value, tuple | list) and len(value) == 3):
        raise TypeError(f"step() must return (observation, reward, done); got {value!r:.200}")
    observation, reward, done = value
    return {"observation": to_wire(observation), "reward": float(reward), "done": bool(done)}


def advance(cls: str, episode: str, row: dict[str, Any], actions: list[str]) -> dict[str, Any]:
    """Bring `episode` to `actions` and return what its last call gave: with no action, reset's
    observation; else the last action's step result."""
    return play(lambda: _environment_class(cls)(), episode, row, actions)


def play(make: Callable[[], Any], episode: str, row: dict[str, Any], actions: list[str]) -> dict[str, Any]:
    """`advance` for any maker of environment objects (rltrain/envs/openenv builds adapters)."""
    phase = episode.rsplit(":", 1)[0]
    with _PHASE_LOCK:
        if phase != _PHASE[0]:
            _LIVE.clear()
            _PHASE[0] = phase
    held = _LIVE.get(episode)
    if not actions or held is None or held[1] != len(actions) - 1:
        env = make()
        first = env.reset(**from_wire(row, f"the row of {episode}"))
        if not actions:
            _LIVE[episode] = (env, 0)
            return {"observation": to_wire(first), "reward": 0.0, "done": False}
        for earlier in actions[:-1]:
            env.step(earlier)
        held = (env, len(actions) - 1)
    env = held[0]
    result = _result(env.step(actions[-1]))
    if result["done"]:
        _LIVE.pop(episode, None)
    else:
        _LIVE[episode] = (env, len(actions))
    return result
