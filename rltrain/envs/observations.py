"""An environment's observation as token ids appended to the episode (token in, token out).

The model's sampled ids are never re-tokenized or re-templated: an observation is tokenized on its
own and appended after them, so the ids the trainer scores are exactly the ids the engine saw.
Text is tokenized as it is. Chat messages are rendered by the chat template as a continuation: the
template applied to a fixed two-message conversation, then to the same conversation plus the new
messages (with the generation prompt), and the difference is the observation. A template whose
rendering of the longer conversation does not start with the shorter one cannot be continued that
way and is refused by name (docs/environments.md, "Observations"). A template that re-renders the
reply before the messages (drops its thinking) is followed: `rewritten_reply`.
"""

from __future__ import annotations

from typing import Any

from rltrain.runtime.errors import UserError

_ANCHOR = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def observation_ids(tokenizer: Any, observation: Any, where: str) -> list[int]:
    """The token ids of `observation` (text, or a list of chat messages) to append to an episode."""
    if isinstance(observation, str):
        return list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    if isinstance(observation, dict):
        observation = [observation]
    if is_messages(observation):
        return list(tokenizer(continuation_text(tokenizer, observation, where), add_special_tokens=False)["input_ids"])
    raise UserError(
        f"{where} returned the observation {observation!r:.200}: an observation is text, or a list of chat "
        "messages ({'role': ..., 'content': ...}), or None to end the episode."
    )


def is_messages(observation: Any) -> bool:
    return isinstance(observation, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in observation)


def rewritten_reply(tokenizer: Any, reply: str, messages: list[dict[str, Any]]) -> str | None:
    """What replaces an episode's last `reply` and the observation `messages` after it when the
    chat template renders that reply differently once they follow it (e.g. without its thinking
    block): the template's text from the reply on, through the next generation prompt. None where
    the template keeps the reply as sampled, or renders the turn before it differently too."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    turn = [_ANCHOR[0], {"role": "assistant", "content": reply}]
    said = tokenizer.apply_chat_template(turn, tokenize=False)
    full = tokenizer.apply_chat_template(turn + messages, tokenize=False, add_generation_prompt=True)
    if full.startswith(said):
        return None
    asked = tokenizer.apply_chat_template(turn[:1], tokenize=False, add_generation_prompt=True)
    return full[len(asked) :] if full.startswith(asked) else None


def continuation_text(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> str:
    """What the chat template adds after an assistant turn for `messages` (and the next generation prompt)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            f"{where} returned chat messages, but the tokenizer has no chat template to render them: return text instead."
        )
    base = tokenizer.apply_chat_template(_ANCHOR, tokenize=False)
    full = tokenizer.apply_chat_template(_ANCHOR + messages, tokenize=False, add_generation_prompt=True)
    if not full.startswith(base):
        raise UserError(
            f"{where} returned chat messages, but this tokenizer's chat template renders a conversation differently "
            "once messages follow it, so they cannot be appended as tokens: return the observation as text."
        )
    return full[len(base) :]
