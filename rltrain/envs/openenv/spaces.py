"""Between the model's text and an OpenEnv environment's typed spaces: the reply becomes the
environment's Action (`env.action`, or by default its one text field), the observation's fields
become the next turn's text, and the reset's arguments come from the dataset row.

OpenEnv's Action and Observation are pydantic models; a hosted class and a server answer with the
same dict (`serialize_observation`: every field but `reward`, `done` and `metadata`), so both are
rendered by one rule. docs/environments.md, "OpenEnv".
"""

from __future__ import annotations

import inspect
import json
import typing
import urllib.request
import zlib
from collections.abc import Callable
from typing import Any

from rltrain.runtime.errors import UserError

NOT_OBSERVED = ("reward", "done", "metadata")


def action_class(env_cls: Any) -> Any:
    """The Action subclass `env_cls.step` takes: its `action` annotation, else the first type argument
    of the `Environment[Action, Observation, State]` it subclasses; None where it names none."""
    from openenv.core.env_server.types import Action

    try:
        hint = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # an annotation that does not resolve: fall back to the generic parameters
        hint = None
    if isinstance(hint, type) and issubclass(hint, Action) and hint is not Action:
        return hint
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], Action) and args[0] is not Action:
                return args[0]
    return None


def text_field_of_class(action_cls: Any) -> str | None:
    """The Action's one field besides `metadata`, where it is text."""
    fields = {name: f for name, f in action_cls.model_fields.items() if name != "metadata"}
    if len(fields) == 1:
        name, f = next(iter(fields.items()))
        if f.annotation is str:
            return name
    return None


def text_field_of_schema(schema: dict[str, Any]) -> str | None:
    """The same from a server's Action JSON schema (`GET /schema`)."""
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    if len(properties) == 1:
        name, spec = next(iter(properties.items()))
        if spec.get("type") == "string":
            return name
    return None


def server_schema(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """A running server's `GET /schema` (its action, observation and state JSON schemas)."""
    request = urllib.request.Request(url.rstrip("/") + "/schema", method="GET")
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 - the user's own server
        return json.loads(answer.read())


def action_maker(cls: str | None, url: str | None, action: str | None, env_cls: Any) -> Callable[[str], Any]:
    """text -> what `step` takes: `env.action`'s function, else the Action's one text field filled
    (a hosted class: the Action object; a server: its JSON)."""
    from rltrain.runtime.user_code import load_callable

    if action:
        return load_callable("env.action", action)
    if env_cls is not None:
        action_cls = action_class(env_cls)
        field = text_field_of_class(action_cls) if action_cls is not None else None
        if action_cls is not None and field is not None:
            name: str = field
            return lambda text: action_cls(**{name: text})
        shape = f"its Action {action_cls.__name__} has the fields {list(action_cls.model_fields)}" if action_cls else (
            "its step() names no Action class (annotate `action: MyAction`, or subclass Environment[MyAction, ...])"
        )
        raise UserError(
            f"env.cls={cls!r}: the reply cannot become its Action by default: {shape}, and the default fills an Action "
            "with exactly one text field besides metadata. Give env.action=package.module:function, which takes the "
            "reply's text and returns the Action (docs/environments.md, \"OpenEnv\")."
        )
    schema = server_schema(str(url))
    field = text_field_of_schema(schema.get("action") or {})
    if field is None:
        raise UserError(
            f"env.url={url!r}: the server's Action ({sorted((schema.get('action') or {}).get('properties') or {})}) is not "
            "one text field besides metadata, so the reply cannot become it by default. Give "
            "env.action=package.module:function, which takes the reply's text and returns the Action as a dict "
            "(docs/environments.md, \"OpenEnv\")."
        )
    key: str = field
    return lambda text: {key: text}


def render(fields: dict[str, Any], ending_step: bool) -> str | None:
    """An observation's fields as the next turn's text: a lone text field as it is, anything else
    as its JSON. Nothing to show: None after reset (no first observation), "" after a step (the
    episode goes on: None would end it)."""
    shown = {k: v for k, v in fields.items() if k not in NOT_OBSERVED}
    if len(shown) == 1 and isinstance(text := next(iter(shown.values())), str):
        return text
    if not shown:
        return "" if ending_step else None
    return json.dumps(shown, sort_keys=True, ensure_ascii=False, default=str)


def reset_arguments(row: dict[str, Any], reset: Callable[..., Any] | None) -> dict[str, Any]:
    """The row's columns `reset` takes (all of them where it takes **kwargs; a server filters them
    itself: reset=None), and a `seed` where the row has none: a hash of the prompt, so a prompt's
    group of episodes starts from one state and a replayed episode from the same."""
    kwargs = {k: v for k, v in row.items() if isinstance(v, str | int | float | bool | list | dict) or v is None}
    kwargs.setdefault("seed", zlib.crc32(json.dumps(row.get("prompt"), sort_keys=True, default=str).encode()))
    if reset is None:
        return kwargs
    parameters = inspect.signature(reset).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}
