"""A reasoning model's answer: the text after its thinking block, and which marker ends that block.

The marker is `reward.thinking_end`, or where null the closing tag the tokenizer's chat template
writes; a run hands it to its reward workers in `THINKING_END_ENV`. A completion that opens a
thinking block and never closes it has no answer yet (""). docs/rewards-and-roles.md ("Thinking").
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

THINKING_END_ENV = "RLTRAIN_THINKING_END"
DEFAULT_THINKING_END = "</think>"
THINKING_TAG = re.compile(r"</\w*think\w*>")


def thinking_end_marker(tokenizer, configured: str | None) -> str:
    """`configured` (`reward.thinking_end`), or where it is null the closing thinking tag the
    tokenizer's chat template writes (Qwen3, DeepSeek-R1: `</think>`), else `</think>`."""
    if configured is not None:
        return configured
    template = getattr(tokenizer, "chat_template", None)
    found = THINKING_TAG.search(template) if isinstance(template, str) else None
    return found.group(0) if found else DEFAULT_THINKING_END


def current_end_marker() -> str:
    """This process's marker: its run's, or the default outside a run."""
    return os.environ.get(THINKING_END_ENV, DEFAULT_THINKING_END)


def opening_of(end_marker: str) -> str | None:
    return "<" + end_marker[2:] if end_marker.startswith("</") else None  # </think> closes <think>


def thinking_tokens(token_ids: list[int], decode: Callable[[list[int]], str], end_marker: str) -> int:
    """How many of a completion's tokens its thinking spans: up to the end of its last `end_marker`
    (the shortest decoded prefix holding every one), all of them for a block never closed, else 0."""
    text = decode(token_ids) if end_marker else ""
    wanted = text.count(end_marker) if end_marker else 0
    if not wanted:
        opening = opening_of(end_marker)
        return len(token_ids) if opening is not None and text.lstrip().startswith(opening) else 0
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(token_ids[:mid]).count(end_marker) >= wanted:
            hi = mid
        else:
            lo = mid + 1
    return lo


def answer_after_thinking(text: str, end_marker: str) -> str:
    """The part of `text` after the last `end_marker`; all of it when it has none and opened no
    thinking block; "" when a block was opened and not closed. An empty marker: all of `text`."""
    if not end_marker:
        return text
    head, found, tail = text.rpartition(end_marker)
    if found:
        return tail
    opening = opening_of(end_marker)
    return "" if opening is not None and text.lstrip().startswith(opening) else text
