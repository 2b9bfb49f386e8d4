"""`env=textarena` checked before any model is built: the package installed (else its install
command), the game known, its NLTK data on disk (else one paragraph naming what to stage: TextArena's
word games call `nltk.download` when their module is imported, which needs the network), and its
number of players (1 or 2). docs/environments.md, "TextArena"."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from rltrain.runtime.errors import UserError, require_extra

INSTALL = "textarena==0.7.4"
NLTK_DOWNLOAD = re.compile(r"nltk\.download\(\s*(\[[^\]]*\]|['\"][^'\"]+['\"])")
NLTK_KINDS = ("corpora", "taggers", "tokenizers", "chunkers", "misc", "models", "grammars", "stemmers", "help", "sentiment")
HELPERS = ("textarena.envs.utils.word_lists",)  # modules of the package a game may import that download too


def require_textarena() -> None:
    require_extra("textarena", "env=textarena needs the textarena package", INSTALL, "textarena", "choose another env")


def _spec(game: str):
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        close = [g for g in sorted(ENV_REGISTRY) if g.split("-")[0].lower() == game.split("-")[0].lower()][:6]
        raise UserError(
            f"env.game={game!r} is not a TextArena game{' (close: ' + ', '.join(close) + ')' if close else ''}: give an id of "
            "textarena.envs.registration.ENV_REGISTRY, e.g. env.game=GuessTheNumber-v0 or env.game=TicTacToe-v0."
        )
    return ENV_REGISTRY[game]


def nltk_resources(module: str) -> list[str]:
    """The NLTK resources a game's module (and the package's helpers it imports) downloads on import, read from its source."""
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None:
        return []
    source = Path(found.origin).read_text()
    names = [name for call in NLTK_DOWNLOAD.findall(source) for name in re.findall(r"['\"]([^'\"]+)['\"]", call)]
    for helper in HELPERS:
        if helper in source:
            names += nltk_resources(helper)
    return sorted(set(names))


def _on_disk(resource: str) -> bool:
    import nltk

    for kind in NLTK_KINDS:
        for name in (f"{kind}/{resource}", f"{kind}/{resource}.zip"):
            try:
                nltk.data.find(name)
                return True
            except LookupError:
                continue
    return False


def check_game(game: str | None) -> None:
    """A UserError naming the problem and the fix, for anything that stops `game` from running offline."""
    require_textarena()
    if not game:
        raise UserError("env=textarena needs env.game=ID, a TextArena game (e.g. env.game=GuessTheNumber-v0).")
    spec = _spec(game)
    module = spec.entry_point.split(":")[0]
    missing = [r for r in nltk_resources(module) if not _on_disk(r)]
    if missing:
        raise UserError(
            f"env.game={game!r} downloads NLTK data when it starts ({', '.join(missing)}), and this run does not reach the "
            "network. Stage it once on a machine that does: `.venv/bin/python -m nltk.downloader -d ~/nltk_data "
            f"{' '.join(missing)}` and copy ~/nltk_data here (or point NLTK_DATA at that folder); or choose a game without "
            "word lists (GuessTheNumber-v0, TicTacToe-v0, ...)."
        )
    if players_of(game) not in (1, 2):
        raise UserError(f"env.game={game!r} is a game of more than two players; env=textarena plays one- and two-player games.")


@functools.lru_cache(maxsize=16)
def players_of(game: str) -> int:
    """The game's number of players: the first of 1, 2, 3 its reset accepts (TextArena asserts the count)."""
    import textarena

    env = textarena.make(f"{game}-raw")
    for players in (1, 2, 3):
        try:
            env.reset(num_players=players, seed=0)
            return players
        except AssertionError:
            continue
        except Exception as exc:
            raise UserError(f"env.game={game!r} failed to start ({type(exc).__name__}: {exc}); check the game's id and its data.") from exc
    return 0
