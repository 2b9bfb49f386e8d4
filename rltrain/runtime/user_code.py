"""Importing the user's code that a config key names as `package.module:function`.

One loader, so a reward function, a data map function or an environment fails the same way: a
UserError naming the key, the path and what went wrong, before any model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rltrain.runtime.errors import UserError


def load_callable(key: str, path: str) -> Callable:
    """The callable `path` names (`package.module:function`, or `package.module.function`)."""
    module_name, _, attr = path.partition(":")
    if not attr:
        module_name, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UserError(
            f"{key} {path!r} could not be loaded ({type(exc).__name__}: {exc}). Give it as "
            "'package.module:function' importable from the working directory."
        ) from exc
    if not callable(fn):
        raise UserError(f"{key} {path!r} is not callable.")
    return fn
