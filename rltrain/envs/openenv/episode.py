"""The worker side of `env=openenv`: one `OpenEnvEpisode` per episode, which the call workers hold
and rebuild by replay as they do an `env=python` class (rltrain/envs/hosted.py). Around a hosted
Environment (`env.cls`: a new instance per episode, in this worker) or a session of a running
server (`env.url`: OpenEnv's own client, one WebSocket session per episode, closed when it ends).

`step` returns the `(observation, reward, done)` of env=python: the observation's fields rendered
as text, the step result's reward (None: 0) and done. Anything but an Observation from a hosted
environment is its error, which costs the episode (`env/errors`). docs/environments.md, "OpenEnv".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rltrain.envs.hosted import play
from rltrain.envs.openenv.spaces import action_maker, render, reset_arguments
from rltrain.runtime.user_code import load_callable


@functools.cache
def _environment(cls: str) -> type:
    return load_callable("env.cls", cls)  # type: ignore[return-value]


@functools.cache
def _to_action(cls: str | None, url: str | None, action: str | None) -> Callable[[str], Any]:
    return action_maker(cls, url, action, _environment(cls) if cls else None)


def _fields(observation: Any, where: str) -> tuple[dict[str, Any], float, bool]:
    """A hosted environment's Observation as (fields, reward, done), the shape a server sends."""
    from openenv.core.env_server.types import Observation

    if not isinstance(observation, Observation):
        raise TypeError(f"{where} must return an OpenEnv Observation; got {observation!r:.200}")
    return observation.model_dump(), float(observation.reward or 0.0), bool(observation.done)


class OpenEnvEpisode:
    """One episode of an OpenEnv environment behind env=python's `reset(**row)` / `step(text)`."""

    def __init__(self, cls: str | None, url: str | None, action: str | None) -> None:
        self.to_action = _to_action(cls, url, action)
        self.name = cls or str(url)
        self.env: Any = None
        self.client: Any = None
        if cls:
            self.env = _environment(cls)()
        else:
            from openenv import GenericEnvClient

            self.client = GenericEnvClient(base_url=str(url)).sync()
            self.client.connect()

    def reset(self, **row: Any) -> str | None:
        if self.env is not None:
            fields, _, _ = _fields(self.env.reset(**reset_arguments(row, self.env.reset)), f"{self.name}.reset()")
        else:
            fields = self.client.reset(**reset_arguments(row, None)).observation
        return render(fields, ending_step=False)

    def step(self, text: str) -> tuple[str | None, float, bool]:
        action = self.to_action(text)
        if self.env is not None:
            fields, reward, done = _fields(self.env.step(action), f"{self.name}.step()")
        else:
            result = self.client.step(action)
            fields, reward, done = result.observation, float(result.reward or 0.0), bool(result.done)
        if done:
            self.close()
        return render(fields, ending_step=True), reward, done

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        elif self.env is not None:
            self.env.close()


def advance(
    cls: str | None, url: str | None, action: str | None, episode: str, row: dict[str, Any], actions: list[str],
) -> dict[str, Any]:
    """rltrain/envs/hosted.py's `advance` for OpenEnv episodes (what the trainer calls)."""
    return play(lambda: OpenEnvEpisode(cls, url, action), episode, row, actions)
