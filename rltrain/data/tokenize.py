"""Turning TRL-style text rows into prompt / completion token ids, with an explicit overlong policy.

A completion always ends with the tokenizer's EOS token, so models learn to stop. Conversational
rows (`messages`) are rendered with the tokenizer's chat template: the prompt is every message but
the last with the generation prompt appended, the completion is the last (assistant) message.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.errors import UserError


@dataclass
class TokenizedPair:
    prompt: list[int]
    completion: list[int]


@dataclass
class OverlongStats:
    dropped: int = 0
    truncated: int = 0


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_messages(tokenizer, messages: list[dict], where: str) -> tuple[str, str]:
    """(prompt text, completion text) of a conversation whose last message is the assistant's."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{where}: rows use the conversational 'messages' column but the tokenizer has no chat "
            "template. Use a tokenizer with one, or give prompt/completion columns."
        )
    if not messages or messages[-1].get("role") != "assistant":
        raise UserError(f"{where}: the last message of a conversation must have role 'assistant'.")
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    return prompt, messages[-1]["content"]


def fit_length(
    prompt: list[int], completion: list[int], max_length: int, policy: str, stats: OverlongStats, where: str
) -> TokenizedPair | None:
    """Apply `data.overlong` to a pair longer than `data.max_length`: drop it, cut the completion,
    or stop with an error. Returns None for a dropped pair."""
    if len(prompt) + len(completion) <= max_length:
        return TokenizedPair(prompt, completion)
    if policy == "drop":
        stats.dropped += 1
        return None
    if policy == "truncate" and len(prompt) < max_length:
        stats.truncated += 1
        return TokenizedPair(prompt, completion[: max_length - len(prompt)])
    raise UserError(
        f"{where}: a row has {len(prompt) + len(completion)} tokens, more than data.max_length={max_length}. "
        "Raise data.max_length, or set data.overlong=drop (skip such rows) or data.overlong=truncate "
        "(cut the completion; a prompt longer than the limit is still an error)."
    )
