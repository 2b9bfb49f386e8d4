"""Turning TRL-style text rows into prompt / completion token ids, with an explicit overlong policy.

A completion always ends with the tokenizer's EOS token, so models learn to stop. Conversational
rows (`messages`) are rendered with the tokenizer's chat template: the prompt is every message but
the last with the generation prompt appended, the completion is the last (assistant) message.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.data.vision_inputs import VisionInputs
from rltrain.runtime.errors import UserError


@dataclass
class TokenizedPair:
    prompt: list[int]
    completion: list[int]
    vision: VisionInputs | None = None  # the row's images, when it has any (rltrain.data.vision_rows)


@dataclass
class OverlongStats:
    dropped: int = 0
    truncated: int = 0


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


ENCODE_CHUNK = 4096  # texts per tokenizer call: few calls, and a bounded batch for a large dataset


def encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    """`encode` of each text, in one tokenizer call per `ENCODE_CHUNK` texts: per-call overhead
    dominates short texts."""
    ids: list[list[int]] = []
    for lo in range(0, len(texts), ENCODE_CHUNK):
        ids.extend(tokenizer(texts[lo : lo + ENCODE_CHUNK], add_special_tokens=False)["input_ids"])
    return ids


ROLES = ("system", "user", "assistant", "tool")
MESSAGES_SHAPE = "a non-empty list of messages, each {'role': 'system' | 'user' | 'assistant' | 'tool', 'content': '<text>'}"


def check_messages(messages, where: str, column: str = "messages") -> list[dict]:
    """`messages` itself if it is a conversation in TRL's form, else a UserError naming the fault:
    not a list, an empty list, an item that is not a dict or lacks a role or content, an unknown
    role, or content that is not a string (`datasets` fills a missing field with None)."""
    problem = None
    if not isinstance(messages, list):
        problem = f"holds {type(messages).__name__} {messages!r:.80}"
    elif not messages:
        problem = "holds an empty list"
    else:
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                problem = f"has message {i} = {m!r:.120}, which is not a dict"
            elif m.get("role") is None or m.get("content") is None:
                missing = " and ".join(repr(k) for k in ("role", "content") if m.get(k) is None)
                problem = f"has message {i} = {m!r:.120}, which lacks {missing}"
            elif m["role"] not in ROLES:
                problem = f"has message {i} with the unknown role {m['role']!r} (roles: {', '.join(ROLES)})"
            elif not isinstance(m["content"], str):
                problem = (
                    f"has message {i} whose content is {type(m['content']).__name__} {m['content']!r:.80}, "
                    "not a string"
                )
            if problem:
                break
    if problem:
        raise UserError(f"{where}: a row's {column!r} column {problem}; every row needs {MESSAGES_SHAPE}.")
    return messages


def render_messages(tokenizer, messages: list[dict], where: str) -> tuple[str, str]:
    """(prompt text, completion text) of a conversation whose last message is the assistant's."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{where}: rows use the conversational 'messages' column but the tokenizer has no chat "
            "template. Use a tokenizer with one, or give prompt/completion columns."
        )
    check_messages(messages, where)
    if messages[-1]["role"] != "assistant" or len(messages) < 2:
        raise UserError(
            f"{where}: a conversation must end with the assistant's message (the completion) after at least one "
            f"other (the prompt); a row's roles are {[m['role'] for m in messages]}."
        )
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
