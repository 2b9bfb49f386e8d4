"""The fixed opponent of a two-player `env=textarena` game (`env.opponent`): a scripted function
(`pkg.module:fn`, called with the seat's new messages and its conversation so far, returning the
move) or any OpenAI-compatible endpoint (`http(s)://HOST/v1`, asked with the conversation at
temperature 0, the model named by `env.opponent_model`). It runs in the game's worker: one that
raises or hangs costs its game's episodes, as the game would (docs/environments.md, "TextArena")."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Protocol

from rltrain.runtime.user_code import load_callable

OPPONENT_KEY_ENV = "RLTRAIN_OPPONENT_API_KEY"  # the endpoint's key, where it needs one
REQUEST_TIMEOUT_S = 60.0


class Opponent(Protocol):
    def move(self, observation: str, transcript: list[dict[str, str]]) -> str:
        """The opponent's move for the seat's new messages, given its conversation so far."""


class Scripted:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def move(self, observation: str, transcript: list[dict[str, str]]) -> str:
        move = self.fn(observation, transcript)
        if not isinstance(move, str):
            raise TypeError(f"the opponent {self.fn.__name__} returned {move!r:.100}, not a move (str)")
        return move


class Endpoint:
    def __init__(self, url: str, model: str | None) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key=os.environ.get(OPPONENT_KEY_ENV, "none"), timeout=REQUEST_TIMEOUT_S, max_retries=1)
        self.model = model or "default"

    def move(self, observation: str, transcript: list[dict[str, str]]) -> str:
        reply = self.client.chat.completions.create(model=self.model, messages=transcript, temperature=0.0)
        return reply.choices[0].message.content or ""


@functools.lru_cache(maxsize=8)
def opponent_for(spec: str, model: str | None = None) -> Opponent:
    """`env.opponent` as an Opponent: a URL is an endpoint, anything else a function's path."""
    if re.match(r"https?://", spec):
        return Endpoint(spec, model)
    return Scripted(load_callable("env.opponent", spec))


def first_listed_move(observation: str, transcript: list[dict[str, str]]) -> str:
    """A scripted opponent for games that list their legal moves (TicTacToe's `Available Moves:
    '[0]', '[1]', ...`): the first move of the latest list."""
    for message in reversed(transcript):
        _, found, listing = message["content"].rpartition("Available Moves:")
        listed = re.findall(r"'(\[[^\]]+\])'", listing.split("\n")[0]) if found else []
        if listed:
            return listed[0]
    return "[0]"
