"""The worker side of an agent episode (env=agent): one call of rltrain/runtime/call_pool.py plays
one episode, so a hung or crashing agent costs that episode only.

`run_episode` points the OpenAI environment variables at the episode's endpoint, tells the endpoint
the episode started (its `env.timeout_s` runs from then), and calls the user's `run(client, row)`
with a ready client: `OpenAI`, or `AsyncOpenAI` for an `async def` agent (handed back as a
coroutine the call worker awaits on an event loop of the episode's own). What it returns is the
episode's reward: a number, or a dict of named numbers (summed). Episodes sharing a worker read the
two variables from a per-episode context variable and share one TLS context, which hundreds of
clients starting together could not each afford (docs/agents.md, "Isolation")."""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import os
import ssl
import threading
import urllib.request
from collections.abc import Coroutine
from typing import Any

import openai

from rltrain.runtime.errors import UserError
from rltrain.runtime.user_code import load_callable


def reward_of(value: Any) -> dict[str, Any]:
    """The episode's reward as a plain message: {"reward": total, "named": {name: value}}; anything
    but a finite number or a dict of them is the agent's error."""
    if isinstance(value, dict):
        named = {}
        for name, v in value.items():
            if not isinstance(name, str) or isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise TypeError(f"the agent's reward dict must map names to finite numbers; got {name!r}: {v!r:.100}")
            named[name] = float(v)
        if not named:
            raise TypeError("the agent returned an empty reward dict")
        return {"reward": sum(named.values()), "named": named}
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"the agent must return its reward, a finite number or a dict of named numbers; got {value!r:.200}")
    return {"reward": float(value), "named": {}}


OPENAI_KEYS = ("OPENAI_BASE_URL", "OPENAI_API_KEY")
_EPISODE_ENV: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("rltrain_episode_env", default=None)


class _EpisodeEnviron(type(os.environ)):  # type: ignore[misc]
    """`os.environ` whose OpenAI variables are the current episode's (a context variable) where one is set."""

    def __getitem__(self, key: str) -> str:
        episode = _EPISODE_ENV.get()
        if episode is not None and key in episode:
            return episode[key]
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        episode = _EPISODE_ENV.get()
        return (episode is not None and key in episode) or super().__contains__(key)


_ENVIRON_LOCK = threading.Lock()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The worker's one TLS context, for every episode's client (the endpoint is plain HTTP, but a
    client builds its context when it is made)."""
    return ssl.create_default_context()


def check_agent(agent: str) -> None:
    """Import `env.agent` and check it takes (client, row): a typo or a wrong signature is a
    UserError in the launcher, seconds in, not an error of every episode once the engines are up."""
    fn = load_callable("env.agent", agent)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable Python cannot describe: its first call tells
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise UserError(
            f"env.agent {agent!r} must take two arguments, (client, row), and return the episode's reward; its "
            f"signature is {fn.__name__}{signature}. docs/agents.md, \"The agent\"."
        ) from None


def run_episode(
    agent: str, base_url: str, api_key: str, row: dict[str, Any], timeout_s: float | None,
) -> dict[str, Any] | Coroutine[Any, Any, dict[str, Any]]:
    """Play one episode of `agent` (`package.module:function`) on `row` against the endpoint at
    `base_url`: its reward, or for an `async def` agent the coroutine that plays it."""
    with _ENVIRON_LOCK:
        os.environ.__class__ = _EpisodeEnviron
        os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = base_url, api_key  # what a subprocess inherits
    _EPISODE_ENV.set(dict(zip(OPENAI_KEYS, (base_url, api_key), strict=True)))
    start = urllib.request.Request(base_url.rsplit("/v1", 1)[0] + "/start", data=b"{}", method="POST")
    with urllib.request.urlopen(start, timeout=30) as answer:  # noqa: S310 - the rank's own endpoint on 127.0.0.1
        answer.read()
    fn = load_callable("env.agent", agent)
    request_timeout = timeout_s if timeout_s else None
    if inspect.iscoroutinefunction(fn):
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=request_timeout,
            http_client=openai.DefaultAsyncHttpxClient(verify=_tls_context()),
        )
        client.chat.completions  # noqa: B018 - its resources are imported on first use, before the episode's clock matters

        async def play() -> dict[str, Any]:
            async with client:
                return reward_of(await fn(client, row))

        return play()
    with openai.OpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=request_timeout,
        http_client=openai.DefaultHttpxClient(verify=_tls_context()),
    ) as client:
        return reward_of(fn(client, row))
