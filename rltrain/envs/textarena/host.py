"""The worker side of `env=textarena`: TextArena games live in a call worker, one per game, and
`advance` is the only function the trainer calls.

A call names the game and carries *every* move so far (the policy's seats' and the fixed
opponent's), so a worker that does not hold the game (a fresh one that replaced a worker killed for
a hung call) rebuilds it: `reset(num_players, seed)`, then the moves replayed. The opponent's moves
go back to the trainer, which keeps them in the game's log: a replay never asks the opponent again.
Observations are rendered as TextArena's own LLM wrapper renders them (`[GAME] ...`,
`[Player 1] ...`), without the seat's own move echoed back. docs/environments.md, "TextArena".
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import textarena  # imported when the worker starts (its paths are preloaded), not inside a call's time limit

from rltrain.envs.textarena.opponents import Opponent, opponent_for

GAME_ID = -1  # TextArena's sender id of the game's own messages

# game key -> (game, moves applied). Keys are "phase:prompt:game"; a call of another phase drops the last one's games.
_LIVE: dict[str, tuple[Any, int]] = {}
_PHASE: list[str] = [""]
_PHASE_LOCK = threading.Lock()
_RANDOM_LOCK = threading.Lock()  # the global `random` belongs to one game's call at a time


def render(seat: int, messages: list) -> str:
    """A seat's new messages as text, one `[SENDER] message` line each, its own moves left out (they are its reply)."""
    lines = []
    for sender, message, *_ in messages:
        if sender == seat:
            continue
        lines.append(f"[{'GAME' if sender == GAME_ID else f'Player {sender}'}] {message}")
    return "\n".join(lines) + "\n" if lines else ""


class Game:
    """One TextArena game and each seat's conversation so far (what an opponent behind a URL is asked with)."""

    def __init__(self, game: str, num_players: int, seed: int) -> None:
        self.env = textarena.make(f"{game}-raw")
        self.random_state: Any = None
        self._own_random(lambda: self.env.reset(num_players=num_players, seed=seed))  # seeds `random` itself
        self.transcripts: dict[int, list[dict[str, str]]] = {}
        self.done = False

    def _own_random(self, call: Callable[[], Any]) -> Any:
        """TextArena draws from Python's global `random` (seeded at reset): each game's calls run with
        its own state, one at a time per worker, so games played side by side in threads (and a game
        rebuilt by replay) draw what the game alone would."""
        with _RANDOM_LOCK:
            if self.random_state is not None:
                random.setstate(self.random_state)
            try:
                return call()
            finally:
                self.random_state = random.getstate()

    def observe(self) -> tuple[int, str]:
        """Whose move it is and that seat's new messages (kept in its transcript)."""
        seat, messages = self._own_random(self.env.get_observation)
        text = render(seat, messages)
        self.transcripts.setdefault(seat, []).append({"role": "user", "content": text})
        return int(seat), text

    def play(self, seat: int, move: str) -> None:
        self.transcripts.setdefault(seat, []).append({"role": "assistant", "content": move})
        self.done, _ = self._own_random(lambda: self.env.step(move))


def _state(game: Game, opponent_seat: int | None, opponent: Opponent | None, moves_out: list) -> dict[str, Any]:
    """Play the opponent's turns, then what the trainer needs: whose move it is, that seat's new
    messages, or the game's end and every seat's reward."""
    while not game.done:
        seat, text = game.observe()
        if seat != opponent_seat or opponent is None:
            return {"done": False, "to_move": seat, "observation": text, "rewards": {}}
        move = opponent.move(text, game.transcripts[seat])
        moves_out.append([seat, move])
        game.play(seat, move)
    rewards, _ = game._own_random(game.env.close)
    return {"done": True, "to_move": None, "observation": "", "rewards": {str(k): float(v) for k, v in (rewards or {}).items()}}


def advance(
    key: str, game: str, seed: int, num_players: int, moves: list[list[Any]], opponent: str | None = None,
    opponent_seat: int | None = None, opponent_model: str | None = None,
) -> dict[str, Any]:
    """Bring game `key` to `moves` ([seat, text] each, in the order played) and return its state after
    them, the opponent's new moves (`opponent_moves`) included."""
    phase = key.rsplit(":", 2)[0]
    with _PHASE_LOCK:
        if phase != _PHASE[0]:
            _LIVE.clear()
            _PHASE[0] = phase
    player = opponent_for(opponent, opponent_model) if opponent else None
    held = _LIVE.get(key)
    if not moves or held is None or held[1] != len(moves) - 1:
        state = Game(game, num_players, seed)
        for seat, text in moves[:-1]:
            if state.done:
                raise RuntimeError(f"the replay of game {key} ended before its last move: the game is not deterministic")
            state.observe()
            state.play(int(seat), str(text))
    else:
        state = held[0]
    opponent_moves: list = []
    if moves:
        seat, _ = state.observe()
        state.play(seat, str(moves[-1][1]))
    result = _state(state, opponent_seat, player, opponent_moves)
    if result["done"]:
        _LIVE.pop(key, None)
    else:
        _LIVE[key] = (state, len(moves) + len(opponent_moves))
    return {**result, "opponent_moves": opponent_moves}
