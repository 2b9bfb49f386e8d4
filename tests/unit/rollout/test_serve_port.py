"""`python -m rltrain.serve` and its port (docs/rollout-servers.md): a port something holds is
refused by name before anything loads, and so is one taken while the server started (the server's
own bind failed), each one paragraph with exit 2; `rollout=server` is implied."""

from __future__ import annotations

import socket
import sys

import pytest

from rltrain import serve
from rltrain.config.group_options import ServerRolloutConfig, ServersConfig
from rltrain.rollout.server import process
from rltrain.rollout.server.process import free_port, port_problem


@pytest.fixture
def listener():
    """A plain socket listening on a port of 127.0.0.1: "something" that holds it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_a_port_something_listens_on_is_taken_and_a_free_one_is_not(listener):
    assert port_problem("127.0.0.1", listener) == "taken"
    assert port_problem("0.0.0.0", listener) == "taken"  # every interface includes the one it holds
    assert port_problem("127.0.0.1", free_port()) is None


def test_a_port_taken_while_the_server_started_is_refused_naming_it(monkeypatch, capsys):
    """The check before loading passes; something takes the port while the config loads, so the
    server's own bind fails and it exits: the same paragraph, not vLLM's traceback."""
    port = free_port()
    holder = socket.socket()

    def config_while_the_port_is_taken(host, port_, overrides):
        holder.bind(("127.0.0.1", port_))
        holder.listen()
        return ServerRolloutConfig(servers=ServersConfig(start_timeout_s=60)), "model", "float32", False

    bind = f"import socket; socket.socket().bind(('127.0.0.1', {port}))"
    monkeypatch.setattr(serve, "_run_server_config", config_while_the_port_is_taken)
    monkeypatch.setattr(process, "server_command", lambda *args: [sys.executable, "-c", bind])
    try:
        code = serve.main(["--host", "127.0.0.1", "--port", str(port)])
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("rltrain: error: ") and f"port {port}" in err and "--port" in err, err
    assert "taken while this server started" in err


def test_rollout_server_is_implied_unless_the_overrides_choose_a_rollout():
    assert serve.with_server_rollout(["algo=grpo"]) == ["rollout=server", "algo=grpo"]
    assert serve.with_server_rollout(["rollout=vllm", "rollout.timeout_s=3"]) == ["rollout=vllm", "rollout.timeout_s=3"]
    assert serve.with_server_rollout(["rollout.servers.spawn=0"])[0] == "rollout=server"
