"""`env=textarena` (rltrain/envs/textarena): real TextArena games in real call workers, played by a
scripted engine (a function of the ids it is given) through the episode runner: self-play pairs,
each seat's own reward, a fixed opponent that raises, hangs or returns garbage costing its own
games, a game rebuilt by replay, and the NLTK refusal."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from rltrain.data.prompt_data import PromptRow
from rltrain.envs import textarena as _  # noqa: F401  (the package imports)
from rltrain.envs.episodes import EpisodeRunner
from rltrain.envs.textarena import host
from rltrain.envs.textarena.game_check import check_game
from rltrain.envs.textarena.steps import TextArenaGames
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.runtime.errors import UserError

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
OPPONENTS = "ecosystem_opponents"


@dataclass
class EnvCfg:
    game: str
    opponent: str | None = None
    opponent_model: str | None = None
    policy_seat: int = 0
    max_turns: int = 6
    max_tokens_per_turn: int | None = None
    max_total_tokens: int = 4000
    timeout_s: float | None = 2.0
    workers: int = 1
    max_concurrency: int = 256


@dataclass
class RewardCfg:
    on_failure: float = -2.0
    max_failure_frac: float = 1.0


def first_listed(prompts: list[list[int]], sampling: SamplingSettings, images=None) -> list[Completion]:
    """The engine stand-in: each episode plays the first move its latest `Available Moves` lists."""
    out = []
    for i, ids in enumerate(prompts):
        listing = TOKENIZER.decode(ids).rpartition("Available Moves:")[2]
        move = re.findall(r"'(\[\d\])'", listing)[0]
        reply = TOKENIZER(move, add_special_tokens=False)["input_ids"] + [EOS]
        out.append(Completion(i, reply, [-0.5] * len(reply), True))
    return out


def play(env_cfg: EnvCfg, players: int, copies: int, n_rows: int = 1):
    steps = TextArenaGames(env_cfg, RewardCfg(), TOKENIZER, players)  # type: ignore[arg-type]
    runner = EpisodeRunner(env_cfg, RewardCfg(), TOKENIZER, 8, 600, steps, steps.prompts)  # type: ignore[arg-type]
    rows = [PromptRow(TOKENIZER(f"[g #{i}]\n")["input_ids"], f"[g #{i}]\n", {}) for i in range(n_rows)]
    try:
        return runner.run(rows, copies, SamplingSettings(n=copies, stop_token_ids=[EOS]), "train-0", first_listed)
    finally:
        runner.close()


def test_self_play_pairs_a_groups_episodes_and_trains_each_seat_with_its_own_reward():
    """Both seats play the first listed square: 0, 1, 2, 3, 4, 5, 6, and seat 0 wins on the 2-4-6 diagonal."""
    played = play(EnvCfg("TicTacToe-v0"), players=2, copies=2)
    assert played.returns == [1.0, -1.0]
    assert played.turns == 7.0  # seat 0 four moves, seat 1 three: the waiting seat sampled nothing
    texts = [TOKENIZER.decode(c.token_ids) for c in played.completions]
    assert "As Player 0" in texts[0] and "As Player 1" in texts[1]
    assert texts[1].count("[Player 0]") == 4 - 1  # seat 1 saw seat 0's moves before each of its own
    for c in played.completions:  # only the seat's own moves are sampled
        sampled = TOKENIZER.decode([t for t, s in zip(c.token_ids, c.sampled, strict=True) if s])
        assert re.fullmatch(r"(\[\d\]<eos>)+", sampled), sampled


def test_an_unpaired_episode_plays_both_seats_and_scores_seat_0():
    played = play(EnvCfg("TicTacToe-v0", max_turns=9), players=2, copies=1)
    assert played.returns == [1.0] and played.turns == 7.0


def test_a_faulty_opponent_costs_its_own_games_never_the_run(monkeypatch, tmp_path):
    """Calls raise, hang (past env.timeout_s, its worker replaced), return garbage, or play: the
    failed games end with reward.on_failure, counted; the others play to the end."""
    tests = str(Path(__file__).resolve().parents[2])
    monkeypatch.syspath_prepend(tests)
    monkeypatch.setenv("PYTHONPATH", tests)
    monkeypatch.setenv("ECOSYSTEM_OPPONENT_CALLS", str(tmp_path / "calls"))
    cfg = EnvCfg("TicTacToe-v0", opponent=f"{OPPONENTS}:faulty", policy_seat=1, max_concurrency=1)
    played = play(cfg, players=2, copies=4)
    assert played.failures.errors == 2 and played.failures.timeouts == 1
    # The one game played to the end: both seats take the first listed square, and seat 0 (the opponent) wins.
    assert played.returns == [-2.0, -2.0, -2.0, -1.0]


def test_a_game_rebuilt_by_replay_reaches_the_state_it_was_in():
    """A worker that lost a game (a fresh one after a kill) replays every move, the opponent's from
    the log, and answers as the worker that held it would have."""
    opponent = "rltrain.envs.textarena.opponents:first_listed_move"
    first = host.advance("p:0:0", "TicTacToe-v0", 5, 2, [], opponent, 1)
    moves = [[0, "[4]"]]
    held = host.advance("p:0:0", "TicTacToe-v0", 5, 2, moves, opponent, 1)
    moves += held["opponent_moves"] + [[0, "[8]"]]
    kept = host.advance("p:0:0", "TicTacToe-v0", 5, 2, moves, opponent, 1)
    host._LIVE.clear()
    rebuilt = host.advance("p:0:0", "TicTacToe-v0", 5, 2, moves, opponent, 1)
    assert first["to_move"] == 0 and held["opponent_moves"] == [[1, "[0]"]]
    assert rebuilt == kept and "[Player 1]" in kept["observation"] and "[Player 0]" not in kept["observation"]


def test_a_game_that_downloads_nltk_data_is_refused_naming_what_to_stage(monkeypatch, tmp_path):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(UserError, match=r"downloads NLTK data when it starts \(words\).*nltk.downloader -d ~/nltk_data words"):
        check_game("Hangman-v0")
    with pytest.raises(UserError, match="not a TextArena game"):
        check_game("TicTacTo-v0")
    check_game("TicTacToe-v0")  # no word lists: nothing to stage


def test_an_opponent_behind_a_url_is_asked_with_its_seats_conversation():
    """Endpoint.move against a local OpenAI-compatible answerer (the chat completions wire format):
    the request carries the model name, temperature 0 and the transcript; the reply's text is the move."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from rltrain.envs.textarena.opponents import opponent_for

    seen: list[dict] = []

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "[7]"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        transcript = [{"role": "user", "content": "[GAME] your move"}]
        move = opponent_for(f"http://127.0.0.1:{server.server_port}/v1", "judge-7").move("[GAME] your move", transcript)
    finally:
        server.shutdown()
    assert move == "[7]"
    assert seen[0]["model"] == "judge-7" and seen[0]["temperature"] == 0.0 and seen[0]["messages"] == transcript


def test_games_side_by_side_draw_what_each_game_alone_would():
    """TextArena deals from Python's global `random`: Blackjack's hit after another game's reset and hit
    draws the card it draws alone (each game keeps its own random state), so replays are exact."""

    def hit(beside_another: bool) -> str:
        game = host.Game("Blackjack-v0", 1, 3)
        if beside_another:
            other = host.Game("Blackjack-v0", 1, 4)
            other.observe()
            other.play(0, "[hit]")
        game.observe()
        game.play(0, "[hit]")
        return game.observe()[1]

    assert hit(False) == hit(True)
