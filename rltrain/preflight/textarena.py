"""`env=textarena`'s own keys checked before any model is built (docs/environments.md, "TextArena");
the game itself (installed, known, its NLTK data staged, its players) by rltrain.envs.textarena.game_check."""

from __future__ import annotations

from rltrain.config.schema import Config
from rltrain.envs.textarena.game_check import check_game, players_of
from rltrain.runtime.errors import UserError


def validate_textarena(cfg: Config) -> None:
    env = cfg.env
    if list(cfg.reward.fns) or cfg.reward_model.name != "none":
        raise UserError(
            "env=textarena takes its rewards from the game (each seat's reward when it ends); reward.fns and reward_model "
            "are not called. Remove them."
        )
    check_game(env.game)
    players = players_of(env.game)
    if env.opponent and players != 2:
        raise UserError(f"env.opponent={env.opponent!r} is set but env.game={env.game!r} is a one-player game: remove env.opponent.")
    if env.policy_seat not in (0, 1) or (players == 1 and env.policy_seat != 0):
        raise UserError(f"env.policy_seat={env.policy_seat} must be 0 or 1 (0 in a one-player game).")
    if env.opponent and not env.opponent.startswith(("http://", "https://")) and ":" not in env.opponent:
        raise UserError(
            f"env.opponent={env.opponent!r} is neither pkg.module:function (a scripted opponent) nor an OpenAI-compatible "
            "URL (http://HOST:PORT/v1)."
        )
    if players == 2 and not env.opponent and cfg.algo.group_size % 2:
        raise UserError(
            f"env.game={env.game!r} in self-play pairs a group's episodes seat 0 / seat 1: algo.group_size={cfg.algo.group_size} "
            "must be even (or set env.opponent)."
        )
