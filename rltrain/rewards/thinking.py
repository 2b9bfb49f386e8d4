"""A reasoning model's answer: the text after its thinking block.

A completion that opens a thinking block and never closes it has no answer yet ("" ), so a reward
never scores half-finished reasoning. The marker is `reward.thinking_end`; docs/rewards-and-roles.md.
"""

from __future__ import annotations


def answer_after_thinking(text: str, end_marker: str) -> str:
    """The part of `text` after the last `end_marker`; all of it when it has none and opened no
    thinking block; "" when a block was opened and not closed. An empty marker: all of `text`."""
    if not end_marker:
        return text
    head, found, tail = text.rpartition(end_marker)
    if found:
        return tail
    opening = "<" + end_marker[2:] if end_marker.startswith("</") else None  # </think> closes <think>
    return "" if opening is not None and text.lstrip().startswith(opening) else text
