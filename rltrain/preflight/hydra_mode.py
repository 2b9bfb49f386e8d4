"""Hydra's run mode from the command line, without composing the whole config for it.

Hydra composes the full config once only to read `hydra.mode`, then again to run it: every launch
paid for two compositions. No config of rltrain sets `hydra.mode`, so where the command line cannot
set it either (no override of `hydra.mode` or the search path, no recipe, no config directory or name of the user's), `-m`
decides, as Hydra itself then does; otherwise Hydra's own lookup runs. docs/internals/launch.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

# Where a user's config could set `hydra.mode`: an override of it (or of Hydra's search path), a recipe
# (`+experiment=`, which may come from the user's search path), another primary config or directory.
_MAY_SET_MODE = ("hydra.mode", "hydra.searchpath", "experiment")
_CONFIG_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")


def mode_may_be_configured(overrides: Sequence[str], argv: Sequence[str]) -> bool:
    """Whether this command's config may set `hydra.mode` (then Hydra composes to read it)."""
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    return any(k.startswith(_MAY_SET_MODE) for k in keys) or any(a.split("=", 1)[0] in _CONFIG_FLAGS for a in argv)


@contextlib.contextmanager
def mode_from_the_command_line(argv: Sequence[str]) -> Iterator[None]:
    """Inside: Hydra's `get_mode` answers "not configured" (so `-m` picks multirun, else a single
    run) unless `mode_may_be_configured`."""
    from hydra._internal.hydra import Hydra

    composing = Hydra.get_mode

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        return composing(self, config_name, overrides) if mode_may_be_configured(overrides, argv) else None

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = composing
