"""Enum-like string fields: `choice()` attaches a `Literal`'s values to a schema field, `choices_of()`
reads them back. Both schema modules (schema.py, group_options.py) declare their fields with it, and
rltrain.preflight.validate refuses any other value, naming the allowed ones."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, get_args


def choice(default: str, allowed: Any) -> Any:
    """A string field whose values are the `Literal` `allowed`. OmegaConf types it as `str` (it has
    no Literal type); rltrain.preflight.validate refuses any other value, naming the allowed ones."""
    values = get_args(allowed)
    assert default in values, f"default {default!r} is not one of {values}"
    return field(default=default, metadata={"choices": values})


def choices_of(cls: type) -> dict[str, tuple[str, ...]]:
    """{field name: allowed values} of the `choice()` fields of a schema dataclass."""
    return {f.name: f.metadata["choices"] for f in dataclasses.fields(cls) if "choices" in f.metadata}
