"""`python -m rltrain.serve [--host H] [--port P] <the run's overrides>`: one vLLM API server for
`rollout=server`, on an inference machine.

The overrides are the run's, composed and validated as the run composes them, so a server never
runs what the run would refuse (exit 2, one paragraph) and serves the run's model, dtype and
limits, with what the trainer needs to push weights into it (our worker extension, vLLM's dev-mode
RPC). It prints the URL to give the trainer (`rollout.servers.urls`) once the server answers, then
stays in the foreground until stopped. docs/rollout-servers.md.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

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
    parser.add_argument("--port", type=int, default=8000)
    args, overrides = parser.parse_known_args(argv)
    try:
        return _serve(args.host, args.port, overrides)
    except UserError as exc:
        print(format_error(str(exc)), file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


def _serve(host: str, port: int, overrides: list[str]) -> int:
    import torch

    from rltrain.config.group_choice import as_option
    from rltrain.config.group_options import ServerRolloutConfig
    from rltrain.models.model_dir import resolve_model_dir
    from rltrain.preflight.validate import validate
    from rltrain.rollout.server_http import is_up
    from rltrain.rollout.server_process import server_command, server_env
    from rltrain.runtime.precision import resolve_precision

    try:
        cfg = compose_run_config(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors are the user's to fix
        raise UserError(f"the overrides do not compose: {exc}") from exc
    rollout = as_option("rollout", cfg.rollout, ServerRolloutConfig)
    if rollout is None:
        raise UserError(
            f"python -m rltrain.serve serves rollout=server runs; these overrides choose rollout={cfg.rollout.name}. "
            "Add rollout=server (and the run's other overrides)."
        )
    if rollout.servers.spawn == 0 and not rollout.servers.urls:  # a served run names its servers later
        cfg.rollout.servers.urls = [f"http://{host}:{port}"]
    validate(cfg)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model_dir = resolve_model_dir(cfg.model, cfg.data, cfg.trainer)
    dtype = resolve_precision(cfg.trainer.precision, device).compute_dtype_name
    proc = subprocess.Popen(server_command(rollout, model_dir, dtype, host, port, cuda), env=server_env(rollout, cuda))
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    local = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + rollout.servers.start_timeout_s
    while proc.poll() is None and not is_up(local):
        if time.monotonic() > deadline:
            proc.terminate()
            break
        time.sleep(1.0)
    if proc.poll() is None:
        name = socket.getfqdn() if host in ("0.0.0.0", "::") else host
        print(f"rltrain: serving {model_dir} at http://{name}:{port} (give it to the trainer: "
              f"'rollout.servers.urls=[http://{name}:{port}]')", flush=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
