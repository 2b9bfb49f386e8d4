"""Config values as plain Python, and back as a command-line override: data=reasoning_gym's
`data.tasks` (OmegaConf lists and mappings of the generators' settings) go to the generators as plain
values and to the SFT start's child run as one Hydra override (rltrain/models/tiny_sft.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def plain(value: Any) -> Any:
    """An OmegaConf list or mapping (or a plain one) as plain Python lists, dicts and scalars."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [plain(v) for v in value]
    return value


def tasks_override(tasks: list[Any]) -> str:
    """`data.tasks` as one Hydra command-line override (the SFT start's child run gets the same tasks)."""

    def render(value: Any) -> str:
        value = plain(value)
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{render(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ",".join(render(v) for v in value) + "]"
        return "null" if value is None else json.dumps(value)

    return "data.tasks=" + render(list(tasks))
