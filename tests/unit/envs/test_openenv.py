"""`env=openenv`'s parts in one process (docs/environments.md, "OpenEnv"): the reply as the Action,
the observation as text, the reset's arguments; one episode against a hosted Environment and the
same against OpenEnv's own server and client (tests/ecosystems/openenv_answer.py, written against
openenv-core's API); and what the launcher refuses, each in one paragraph. The runs themselves:
tests/e2e/test_cli_openenv.py."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers import compose_config

from rltrain.envs.openenv import check, spaces
from rltrain.envs.openenv.episode import OpenEnvEpisode
from rltrain.preflight.validate import validate
from rltrain.runtime.errors import UserError

ENVS = Path(__file__).resolve().parents[2] / "ecosystems"
CLS = "openenv_answer:AnswerEnvironment"


@pytest.fixture(autouse=True)
def answer_env_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS))


def test_the_reply_becomes_the_action_and_the_observation_text():
    import openenv_answer
    from openenv_shapes import Board, Move, Unannotated

    # The Action class: step's annotation, else Environment[Action, ...]'s first argument.
    assert spaces.action_class(openenv_answer.AnswerEnvironment) is openenv_answer.AnswerAction
    assert spaces.action_class(Unannotated) is Move
    assert spaces.text_field_of_class(openenv_answer.AnswerAction) == "text"
    assert spaces.text_field_of_class(Move) is None
    assert spaces.text_field_of_schema(openenv_answer.AnswerAction.model_json_schema()) == "text"
    assert spaces.text_field_of_schema(Move.model_json_schema()) is None
    with pytest.raises(UserError, match=r"has the fields \['metadata', 'x', 'y'\].*Give env.action=package.module:function"):
        spaces.action_maker("m:Unannotated", None, None, Unannotated)
    make = spaces.action_maker(CLS, None, None, openenv_answer.AnswerEnvironment)
    assert make(" 4") == openenv_answer.AnswerAction(text=" 4")
    # A lone text field is shown as it is; several fields as their JSON; none: no first observation,
    # an empty turn after a step (None would end the episode).
    assert spaces.render({"message": " again:", "reward": 1.0, "done": False, "metadata": {}}, ending_step=True) == " again:"
    assert spaces.render(Board(cells=[1, 2], note="hi").model_dump(), ending_step=True) == '{"cells": [1, 2], "note": "hi"}'
    assert spaces.render({"metadata": {}}, ending_step=False) is None
    assert spaces.render({}, ending_step=True) == ""
    # reset gets the row's columns its signature takes, and a seed per prompt (a group shares it).
    row = {"prompt": "1+1=", "answer": "2", "fault": ""}
    env = openenv_answer.AnswerEnvironment()
    kwargs = spaces.reset_arguments(row, env.reset)
    assert kwargs["answer"] == "2" and kwargs["seed"] == spaces.reset_arguments({**row, "answer": "3"}, env.reset)["seed"]
    assert set(spaces.reset_arguments(row, Unannotated().reset)) == {"seed"}
    assert spaces.reset_arguments({**row, "seed": 7}, None)["seed"] == 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_episode_plays_a_hosted_class_and_a_server_session_alike():
    """The same replies reach the same observations, rewards and ends, hosted or by URL (OpenEnv's
    create_app under uvicorn, its GenericEnvClient); garbage from the environment is its error."""
    import openenv_answer
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(openenv_answer.app, host="127.0.0.1", port=free_port(), log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.config.port}"
        check.check_openenv(compose_config("env=openenv", f"env.url={url}").env)  # reachable, one text field
        played = []
        for cls, where in ((CLS, None), (None, url)):
            episode = OpenEnvEpisode(cls, where, None)
            played.append([episode.reset(prompt="3+3=", answer="6"), episode.step("5"), episode.step(" 6")])
        assert played[0] == played[1] == [" answer:", (" again:", 0.1, False), (" again:", 1.0, True)]
        for cls, where, error in ((CLS, None, TypeError), (None, url, RuntimeError)):
            episode = OpenEnvEpisode(cls, where, None)
            episode.reset(prompt="3+3=", answer="6", fault="garbage")
            with pytest.raises(error):
                episode.step("6")
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "env=openenv needs one of env.cls=package.module:Environment (the run hosts it) or env.url"),
        ([f"env.cls={CLS}", "env.url=http://127.0.0.1:9"], "env=openenv needs one of"),
        (["env.url=localhost:8000"], "must be a server's base URL"),
        ([f"env.cls={CLS}", "env.action=nocolon"], "env.action='nocolon' must be package.module:function"),
        ([f"env.cls={CLS}", "reward.fns=[rltrain.rewards.builtin:exact_match]"], "env=openenv takes its rewards from"),
        (["env=python", "env.cls=higher_lower:HigherLower", "env.url=http://127.0.0.1:9"], "env.url is set but env=python"),
    ],
)
def test_what_env_openenv_cannot_run_is_refused_by_name(overrides, message):
    cfg = compose_config("algo=grpo", "env=openenv", *overrides)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg)


def test_the_launcher_checks_the_class_the_server_and_the_package(monkeypatch):
    with pytest.raises(UserError, match="is not an OpenEnv Environment subclass"):
        check.check_openenv(compose_config("env=openenv", "env.cls=openenv_answer:AnswerAction").env)
    with pytest.raises(UserError, match=r"env.url='http://127.0.0.1:9' could not be reached .*start the OpenEnv server"):
        check.check_openenv(compose_config("env=openenv", "env.url=http://127.0.0.1:9").env)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openenv" else real(name, *a))
    with pytest.raises(UserError, match=r"not installed .* `.venv/bin/python -m pip install 'openenv-core==0.3.0'` \(the rltrain\[openenv\] extra"):
        check.require_openenv()
