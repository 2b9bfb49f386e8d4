"""Example tools for `env=tools`: plain typed functions; the schema the model sees comes from the type
hints and the docstring (a line per argument under "Args:").

    PYTHONPATH=examples python -m rltrain algo=grpo env=tools \
        'env.tools=[calculator:add,calculator:subtract]'

A tool may be slow, hang or raise: each call runs in a worker process under env.timeout_s, and a
failure is read back to the model as an error (docs/environments.md, "Tools").
"""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract one integer from another.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return a - b
