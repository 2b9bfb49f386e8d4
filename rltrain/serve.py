"""`python -m rltrain.serve [--host H] [--port P] <the run's overrides>`: one vLLM API server for
`rollout=server` (implied), on an inference machine.

The overrides are the run's, composed and validated as the run composes them, so a server never
runs what the run would refuse (exit 2, one paragraph) and serves the run's model, dtype and
limits, with what the trainer needs to push weights into it (our worker extension, vLLM's dev-mode
RPC). A port something already holds is refused (exit 2) before anything loads. It prints the URL
to give the trainer (`rollout.servers.urls`) once the server answers there as itself (the identity
its worker reports), then stays in the foreground until stopped. docs/rollout-servers.md.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
import uuid

from rltrain.runtime.errors import EXIT_USER_ERROR, UserError, format_error


def compose_run_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from rltrain.config.schema import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltrain.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000); refused if taken")
    args, overrides = parser.parse_known_args(argv)
    try:
        return _serve(args.host, args.port, overrides)
    except UserError as exc:
        print(format_error(str(exc)), file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


def port_refusal(host: str, port: int, problem: str, when: str = "") -> UserError:
    if problem != "taken":
        return UserError(f"cannot listen on {host}:{port} ({problem}): pick another --host or --port N.")
    return UserError(
        f"port {port} on {host} is taken{when}: something else listens there (another server?), and the URL this "
        f"server would print would reach it. Start this one on a free port with --port N, or stop what holds {port}."
    )


def with_server_rollout(overrides: list[str]) -> list[str]:
    """The overrides with `rollout=server` first unless they choose a rollout group themselves."""
    chooses = any(o.lstrip("+~").split("=", 1)[0] == "rollout" for o in overrides)
    return overrides if chooses else ["rollout=server", *overrides]


def _serve(host: str, port: int, overrides: list[str]) -> int:
    from rltrain.rollout.server.process import port_problem

    problem = port_problem(host, port)
    if problem is not None:
        raise port_refusal(host, port, problem)
    rollout, model_dir, dtype, cuda = _run_server_config(host, port, overrides)
    from rltrain.rollout.server.process import is_ours, server_command, server_env

    identity = uuid.uuid4().hex
    proc = subprocess.Popen(server_command(rollout, model_dir, dtype, host, port, cuda), env=server_env(rollout, cuda, identity))
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    local = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + rollout.servers.start_timeout_s
    # Each second: first whether the server exited (a lost bind race ends it at once), then whether
    # it answers as itself. Asking first would wait out is_ours's timeout on whatever silently
    # holds the port, while the server's exit went unseen.
    while not _exited_within(proc, 1.0) and not is_ours(local, identity):
        if time.monotonic() > deadline:
            proc.terminate()
            break
    if proc.poll() is not None and proc.returncode != 0 and port_problem(host, port) == "taken":  # vLLM's bind lost a race
        raise port_refusal(host, port, "taken", " (taken while this server started)")
    if proc.poll() is None:
        name = socket.getfqdn() if host in ("0.0.0.0", "::") else host
        print(f"rltrain: serving {model_dir} at http://{name}:{port} (give it to the trainer: "
              f"'rollout.servers.urls=[http://{name}:{port}]')", flush=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


def _exited_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether `proc` exits within `seconds` (returning as soon as it does): the serve loop's tick."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _run_server_config(host: str, port: int, overrides: list[str]):
    """The run's rollout config, model directory, compute dtype and device, validated as the run's."""
    import torch

    from rltrain.config.group_choice import as_option
    from rltrain.config.group_options import ServerRolloutConfig
    from rltrain.models.model_dir import resolve_model_dir
    from rltrain.preflight.validate import validate
    from rltrain.runtime.precision import resolve_precision

    try:
        cfg = compose_run_config(with_server_rollout(overrides))
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors are the user's to fix
        raise UserError(f"the overrides do not compose: {exc}") from exc
    rollout = as_option("rollout", cfg.rollout, ServerRolloutConfig)
    if rollout is None:
        raise UserError(
            f"python -m rltrain.serve serves rollout=server runs; these overrides choose rollout={cfg.rollout.name}. "
            "Drop that override (rollout=server is implied) and keep the run's others."
        )
    if rollout.servers.spawn == 0 and not rollout.servers.urls:  # a served run names its servers later
        cfg.rollout.servers.urls = [f"http://{host}:{port}"]
    validate(cfg)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model_dir = resolve_model_dir(cfg.model, cfg.data, cfg.trainer)
    dtype = resolve_precision(cfg.trainer.precision, device).compute_dtype_name
    return rollout, model_dir, dtype, cuda


if __name__ == "__main__":
    sys.exit(main())
