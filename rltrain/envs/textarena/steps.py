"""`env=textarena`, the trainer's side: `EpisodeSteps` for TextArena games played in call workers.

Every episode plays one seat of a game. A single-player game or one against a fixed opponent
(`env.opponent`, played in the worker) is one episode per game. In self-play (a two-player game, no
opponent) consecutive episodes of a phase share a game, seat 0 and seat 1 (within a GRPO group:
`algo.group_size` even), each trained on its own tokens with its own seat's reward; an episode left
without a partner (an odd count, e.g. one greedy episode per held-out prompt) plays both seats and
scores seat 0's. The seat not to move waits (`Episode.waiting`): the runner samples only the seat
whose turn it is. A failed call ends every episode of its game, which scores `reward.on_failure` and
is counted in `env/timeouts` / `env/errors` (docs/environments.md, "TextArena").
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

from rltrain.config.group_options import TextArenaEnvConfig
from rltrain.config.schema import RewardConfig
from rltrain.envs.episodes import Episode, check_failed_episodes
from rltrain.envs.observations import ObservationRenderer
from rltrain.runtime.call_pool import Call, CallPool, CallResult
from rltrain.runtime.errors import UserError

ADVANCE = "rltrain.envs.textarena.host:advance"
SEED_COLUMN = "seed"  # a row's game seed where the data has one (else its prompt's checksum)


@dataclass
class GameSeats:
    key: str
    seed: int
    seats: dict[int, Episode]  # seat -> the episode that plays it (one episode may play both)
    moves: list[list] = field(default_factory=list)  # [seat, text] of every move so far, the opponent's included
    to_move: int = 0  # the seat whose move the game waits for

    def episodes(self) -> list[Episode]:
        return list({id(e): e for e in self.seats.values()}.values())


def game_seed(row: dict) -> int:
    """A row's game: its `seed` column, else a checksum of its prompt (the rows only number the games)."""
    if SEED_COLUMN in row and row[SEED_COLUMN] is not None:
        return int(row[SEED_COLUMN])
    return zlib.crc32(str(row.get("prompt", "")).encode())


class GameHeader:
    """The prompt of a game's episode: the game's name and a number from the data row's prompt (the
    rows only number the games; the game's own text follows as the first observation)."""

    def __init__(self, game: str) -> None:
        self.game = game

    def text(self, prompt: str) -> str:
        return f"[{self.game} #{zlib.crc32(prompt.encode()) % 1_000_000}]\n"

    def chat(self, messages: list[dict]) -> str:
        return self.text(json.dumps(messages, sort_keys=True, default=str))


class TextArenaGames:
    """`EpisodeSteps` for `env.game`; `players` is the game's number of players (1 or 2)."""

    def __init__(
        self, env_cfg: TextArenaEnvConfig, reward_cfg: RewardConfig, tokenizer, players: int, start_workers: bool = True,
        observations: ObservationRenderer | None = None,
    ) -> None:
        self.cfg, self.reward_cfg, self.players = env_cfg, reward_cfg, players
        self.observations = observations if observations is not None else ObservationRenderer(tokenizer)
        self.timeout_s = float(env_cfg.timeout_s) if env_cfg.timeout_s else None
        self.self_play = players == 2 and not env_cfg.opponent
        self.pool = CallPool(env_cfg.workers, [ADVANCE], "environment", env_cfg.max_concurrency)
        self.prompts = GameHeader(str(env_cfg.game))
        self.games: dict[str, GameSeats] = {}
        self.game_of: dict[str, GameSeats] = {}  # episode key -> its game
        if start_workers:
            self.pool.start()

    def reset(self, episodes: list[Episode], deadline: float) -> None:
        self.games, self.game_of = {}, {}
        step = 2 if self.self_play else 1
        for first in range(0, len(episodes), step):
            pair = episodes[first : first + step]
            phase = pair[0].key.rsplit(":", 1)[0]
            seats = {0: pair[0], 1: pair[-1]} if self.self_play else {self.cfg.policy_seat if self.players == 2 else 0: pair[0]}
            game = GameSeats(f"{phase}:{pair[0].prompt_index}:{first}", game_seed(pair[0].row), seats)
            self.games[game.key] = game
            for e in pair:
                self.game_of[e.key] = game
                e.waiting = True
        self._advance(list(self.games.values()), deadline)

    def step(self, episodes: list[Episode], deadline: float) -> None:
        games = []
        for e in episodes:
            game = self.game_of[e.key]
            game.moves.append([game.to_move, e.actions[-1]])
            games.append(game)
        self._advance(list({g.key: g for g in games}.values()), deadline)

    def check(self, episodes: list[Episode]) -> None:
        check_failed_episodes(episodes, f"the TextArena game {self.cfg.game!r}", self.timeout_s, self.reward_cfg.max_failure_frac,
                              "Check the game (and env.opponent), or raise env.timeout_s or reward.max_failure_frac.")

    def close(self) -> None:
        self.pool.close()

    def _advance(self, games: list[GameSeats], deadline: float) -> None:
        if not games:
            return
        calls = [
            Call(ADVANCE, {
                "key": g.key, "game": self.cfg.game, "seed": g.seed, "num_players": self.players, "moves": g.moves,
                "opponent": self.cfg.opponent, "opponent_seat": (1 - self.cfg.policy_seat) if self.cfg.opponent else None,
                "opponent_model": self.cfg.opponent_model,
            })
            for g in games
        ]
        for game, result in zip(games, self.pool.run(calls, self.timeout_s, deadline), strict=True):
            self._apply(game, result)

    def _apply(self, game: GameSeats, result: CallResult) -> None:
        value = result.value
        if result.failure is not None or not isinstance(value, dict) or "done" not in value:
            for e in game.episodes():
                e.done, e.waiting, e.failure = True, False, "timeout" if result.failure == "timeout" else "error"
                if e.failure == "timeout":
                    e.timeouts += 1
                else:
                    e.errors += 1
            return
        game.moves += value["opponent_moves"]
        if value["done"]:
            for seat, e in sorted(game.seats.items(), reverse=True):  # one episode on both seats scores seat 0's
                e.reward = float(value["rewards"].get(str(seat), 0.0))
                e.done, e.ended_by_env, e.waiting = True, True, False
            return
        game.to_move = int(value["to_move"])
        mover = game.seats.get(game.to_move)
        if mover is None:  # the opponent's seat with no opponent: the game asked for a seat nobody plays
            raise UserError(f"env.game={self.cfg.game!r} asked seat {value['to_move']} to move, which no episode plays.")
        for e in game.episodes():
            e.waiting = e is not mover
        text = value["observation"]
        if text:
            where = f"{self.cfg.game} (seat {value['to_move']})"
            seen = self.observations.render(text, where, mover.chat, mover.open_reply())
            mover.observe(seen, self.cfg.max_total_tokens - len(mover.tokens), self.observations.image_token_id)
