"""Hydra's composition errors as rltrain's one-paragraph user errors (exit 2, docs/failure-behaviour.md).

Hydra reports a misspelt key, a wrong type, an unknown group option or an unparsable override in
its own words and exits 1; its advice for a misspelt key ("To append to your config use +key=...")
is the wrong fix for a schema that has no such key. `python -m rltrain` lets those errors reach it
(`HYDRA_FULL_ERROR` while composing, `reporting_composition_errors`) and says what is wrong and
what to type instead: the nearest known key or option, or the list of them. Any other exception
keeps Hydra's own report.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rltrain.config.schema import Config
from rltrain.runtime.errors import EXIT_USER_ERROR, format_error

_SET_BY_US = "_RLTRAIN_SET_HYDRA_FULL_ERROR"


def _nearest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"Did you mean {close[0]}? " if close else ""


def _known_keys(schema: object) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


# Why a key of one backend is not a key of the other, where a sentence helps more than the key list.
_BACKEND_KEY_REASONS = {
    "ep": (
        "backend=fsdp has no expert parallelism: it shards a Mixture of Experts' experts with every other "
        "weight and runs every expert on every rank (docs/moe.md). For expert parallelism use backend=megatron "
        "backend.ep=N."
    ),
}


# Options users look for that this release does not have, and why (docs/environments.md).
_MISSING_OPTION_REASONS = {
    ("env", "verifiers"): (
        "verifiers environments are not supported yet: verifiers 0.4 exports only its v1 API, whose episodes run "
        "a harness program prepared with uv from the network and ask the model with stream=true, and it needs "
        "openai<3 against rltrain's pinned openai 3 (docs/environments.md, \"What this release does not do\"). "
        "Its tasks run as env=python or env=agent with your own adapter. "
    ),
}


def _other_backend_key(parent: str, key: str, object_type: object) -> str | None:
    """The paragraph for a key that belongs to the other backend option (backend.ep under fsdp)."""
    from rltrain.config.group_options import FSDPBackendConfig, MegatronBackendConfig

    if parent != "backend":
        return None
    for schema in (FSDPBackendConfig, MegatronBackendConfig):
        if schema is not object_type and key in _known_keys(schema):
            here = "fsdp" if schema is MegatronBackendConfig else "megatron"
            return (
                f"backend.{key} is a key of backend={schema.name}, not of backend={here}. "
                + _BACKEND_KEY_REASONS.get(key, f"Use backend={schema.name} to set it.")
            )
    return None


def describe(exc: BaseException) -> str | None:
    """The paragraph for a composition error, or None for any other exception."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        options = sorted(o for o in exc.options or [] if not o.endswith("_schema"))
        why = _MISSING_OPTION_REASONS.get((group, option), _nearest(option, options))
        return (
            f"{group}={option}: there is no such option in the {group!r} group. "
            f"{why}Choose from: {', '.join(options)}."
        )
    if isinstance(exc, OverrideParseException):
        reason = str(exc).splitlines()[0]
        return (
            f"cannot parse the override {exc.override!r}: {reason}. Quote values that contain spaces or "
            "brackets, e.g. 'reward.fns=[pkg.module:fn]' (grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)."
        )
    if isinstance(exc, ConfigCompositionException):
        cause = exc.__cause__
        if isinstance(cause, ConfigAttributeError | ConfigKeyError):
            parent, _, key = (cause.full_key or str(cause.key)).rpartition(".")
            other_backend = _other_backend_key(parent, key, cause.object_type)
            if other_backend is not None:
                return other_backend
            known = _known_keys(cause.object_type)
            where = f"in {parent!r}" if parent else "at the top level"
            hits = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            suggestion = ".".join(filter(None, (parent, hits[0]))) if hits else None
            return (
                f"unknown config key {cause.full_key!r}: there is no {key!r} {where}. "
                + (f"Did you mean {suggestion}? " if suggestion else "")
                + (f"Its keys: {', '.join(known)}. " if known and not suggestion else "")
                + "`python -m rltrain --cfg job` prints every key with its value."
            )
        if isinstance(cause, ValidationError):
            reason = str(cause).splitlines()[0]
            return f"bad value for {cause.full_key!r}: {reason}. Give it a value of the type its default has (`python -m rltrain --cfg job`)."
    return None


@contextmanager
def reporting_composition_errors() -> Iterator[None]:
    """Run `hydra.main(...)(job)()` inside this: a composition error prints one `rltrain: error:`
    paragraph and exits 2; `composition_done()` (the job's first call) restores Hydra's own
    reporting for everything after composing. A user who set HYDRA_FULL_ERROR gets Hydra's full
    traces throughout."""
    if "HYDRA_FULL_ERROR" in os.environ:
        yield
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    os.environ[_SET_BY_US] = "1"
    try:
        yield
    except Exception as exc:
        message = describe(exc)
        if message is None:
            raise
        print(format_error(message), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    finally:
        composition_done()


def composition_done() -> None:
    """Hydra reports what fails from here on in its own way (stripped frames, exit 1); our ranks
    and jobs do not inherit the setting."""
    if os.environ.pop(_SET_BY_US, None):
        os.environ.pop("HYDRA_FULL_ERROR", None)


def added_keys(cfg: Config) -> list[str]:
    """Keys that a `+key=value` override added where the schema has no such key (Hydra accepts
    them; nothing in rltrain would read them, so a misspelt `+` key would be silently ignored)."""
    from omegaconf import DictConfig, OmegaConf

    found: list[str] = []

    def walk(node, prefix: str) -> None:
        schema = OmegaConf.get_type(node)
        known = set(_known_keys(schema)) if dataclasses.is_dataclass(schema) else None  # a free dict: any key
        for key in node:
            path = f"{prefix}{key}"
            if known is not None and key not in known:
                found.append(path)
            elif not OmegaConf.is_missing(node, key) and isinstance(child := node[key], DictConfig):
                walk(child, f"{path}.")

    walk(cfg, "")
    return found
