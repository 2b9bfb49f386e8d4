"""What `env=openenv` checks before any rank, model or engine starts, so a missing package, a typo
or an Action the reply cannot fill is one paragraph in seconds; and what the workers are told
(`hosting`). docs/environments.md, "OpenEnv"."""

from __future__ import annotations

from rltrain.config.group_options import EnvConfig
from rltrain.envs.user_env import Hosting
from rltrain.runtime.errors import UserError, require_extra
from rltrain.runtime.user_code import load_callable

ADVANCE = "rltrain.envs.openenv.episode:advance"
INSTALL = "openenv-core==0.3.0"


def require_openenv() -> None:
    """The package is an optional extra (rltrain[openenv]): not installed is a UserError with its install command."""
    require_extra("openenv", "env=openenv needs OpenEnv", INSTALL, "openenv", "choose another env")


def check_openenv(env: EnvConfig) -> None:
    """Import the environment class, reach the server, and build the default action maker once."""
    from openenv.core.env_server.interfaces import Environment

    from rltrain.envs.openenv.spaces import action_maker, server_schema

    env_cls = None
    if env.cls:
        env_cls = load_callable("env.cls", env.cls)
        if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
            raise UserError(
                f"env.cls={env.cls!r} is not an OpenEnv Environment subclass (openenv.core.env_server.interfaces."
                "Environment): env=openenv hosts OpenEnv environments; a class with reset(**row) and step(text) is env=python."
            )
    if env.url:
        try:
            server_schema(env.url)
        except OSError as exc:
            raise UserError(
                f"env.url={env.url!r} could not be reached ({type(exc).__name__}: {exc}): start the OpenEnv server first "
                "(e.g. `uvicorn my_env.server.app:app --port 8000`) and give its base URL, http://host:port."
            ) from exc
        except ValueError as exc:
            raise UserError(
                f"env.url={env.url!r} did not answer GET /schema with JSON ({exc}): is it an OpenEnv server (create_app)?"
            ) from exc
    action_maker(env.cls, env.url, env.action, env_cls)


def hosting(env: EnvConfig) -> Hosting:
    """The workers import the class, the action function and OpenEnv's client when they start, not
    inside a first call's `env.timeout_s`."""
    preload = [p for p in (env.cls, env.action) if p] + ([] if env.cls else ["openenv:GenericEnvClient"])
    return Hosting(ADVANCE, {"cls": env.cls, "url": env.url, "action": env.action}, str(env.cls or env.url), preload)
