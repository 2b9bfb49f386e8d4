"""A reward function's call in its worker: its arguments cross the JSON pipe with their images and
bytes as markers (rltrain/data/column_wire.py) and are made PIL images and bytes again here, so the
function gets its rows' columns as the trainer holds them. Light on purpose: workers import it.
"""

from __future__ import annotations

from typing import Any

from rltrain.data.column_wire import from_wire
from rltrain.runtime.user_code import load_callable

WORKER_CALL = "rltrain.rewards.worker_call:call_reward"


def call_reward(fn: str, kwargs: dict[str, Any]) -> Any:
    """`fn(**kwargs)`, the markers in `kwargs` decoded; an awaitable result is the worker's to await.
    `fn` was imported when the worker started (the pool lists it), so this finds it loaded."""
    return load_callable("reward function", fn)(**from_wire(kwargs))
