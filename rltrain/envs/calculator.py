"""The built-in tool task's tool (`data.task=multiplication`, `+experiment=grpo_calculator`): the product
the tiny model cannot compute, one call away (docs/environments.md, "The built-in tool task")."""

from __future__ import annotations


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
