"""An environment's observation as token ids appended to the episode (token in, token out).

The model's sampled ids are never re-tokenized or re-templated: an observation is tokenized on its
own and appended after them, so the ids the trainer scores are exactly the ids the engine saw.
Text is tokenized as it is. Chat messages are rendered by the chat template as a continuation: the
template applied to a fixed two-message conversation, then to the same conversation plus the new
messages (with the generation prompt), and the difference is the observation. A template that
re-renders the reply before the messages (drops its thinking) is followed: `rewritten_reply`.
Images (a vision-language model's) become image parts the template marks, expanded to their visual
tokens by the processor. docs/environments.md, "Observations"; docs/vision.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rltrain.data.vision_rows import VisionEncoder
from rltrain.envs.images import decode_data_url
from rltrain.envs.wire import is_image
from rltrain.runtime.errors import UserError

_ANCHOR = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


@dataclass
class Observation:
    ids: list[int]
    images: list = field(default_factory=list)  # PIL images, in the order of their placeholders in `ids`
    # `ids` start with the episode's last reply as the chat template re-renders it once messages
    # follow it (e.g. without its thinking): they replace that reply (`Episode.observe`).
    rewrites_reply: bool = False


class ObservationRenderer:
    """Observations as ids for one model: `processor` (a vision-language model's; None for a
    text-only model, which refuses images) expands each image into its visual tokens."""

    def __init__(self, tokenizer: Any, processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.encoder = VisionEncoder(processor) if processor is not None else None

    @property
    def image_token_id(self) -> int | None:
        """The placeholder id the processor repeats per visual token (None: a text-only model)."""
        if self.encoder is None:
            return None
        return int(self.tokenizer.convert_tokens_to_ids(self.encoder.processor.image_token))

    def render(self, observation: Any, where: str, chat: bool, reply: str | None = None) -> Observation:
        """`observation`: text, an image, a list of text and images, or chat messages (content text
        or parts: text, `{"type": "image", "image": PIL}`, `{"type": "image_url", ...}` with a data
        URL). `chat`: the episode's prompt was chat messages (a bare image then comes as a user
        message; in a text episode as the model's image markup). `reply`: the episode's last reply
        where the observation follows it directly (`Episode.open_reply`), for `rewritten_reply`."""
        if isinstance(observation, dict) and "role" in observation:
            observation = [observation]
        if is_image(observation):
            observation = [observation]
        if isinstance(observation, list) and observation and all(isinstance(v, str) or is_image(v) for v in observation):
            if chat:
                observation = [{"role": "user", "content": [segment_part(v) for v in observation]}]
            else:
                images = [v for v in observation if is_image(v)]
                text = "".join(v if isinstance(v, str) else self._markup(where) for v in observation)
                return self._encode(text, images, where)
        if isinstance(observation, str):
            return Observation(list(self.tokenizer(observation, add_special_tokens=False)["input_ids"]))
        if is_messages(observation):
            messages, images = template_parts(observation, where)
            if images:
                self._markup(where)  # a text-only model refuses images before its template sees them
            rewritten = rewritten_reply(self.tokenizer, reply, messages) if reply is not None else None
            if rewritten is not None:
                return replace(self._encode(rewritten, images, where), rewrites_reply=True)
            return self._encode(continuation_text(self.tokenizer, messages, where), images, where)
        raise UserError(
            f"{where} returned the observation {observation!r:.200}: an observation is text, an image, a list of text "
            "and images, or a list of chat messages ({'role': ..., 'content': ...}), or None to end the episode."
        )

    def _markup(self, where: str) -> str:
        if self.encoder is None:
            raise UserError(
                f"{where} returned an image, but the model is text-only. Train a vision-language model (model=tiny_vl, or "
                "model.path of one AutoModelForImageTextToText loads), or return text."
            )
        return self.encoder.image_markup

    def _encode(self, text: str, images: list, where: str) -> Observation:
        if not images:
            return Observation(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        assert self.encoder is not None
        marks = text.count(self.encoder.processor.image_token)
        if marks != len(images):
            raise UserError(
                f"{where} returned {len(images)} image(s), but the chat template wrote {marks} image placeholder(s) for them: "
                "use a chat template that renders {'type': 'image'} content parts, one placeholder each."
            )
        ids, _ = self.encoder.encode(text, images)
        return Observation(ids, list(images))


def segment_part(value: Any) -> dict[str, Any]:
    return {"type": "image", "image": value} if is_image(value) else {"type": "text", "text": value}


def template_parts(messages: list[dict[str, Any]], where: str) -> tuple[list[dict[str, Any]], list]:
    """Messages as chat templates read them (each image part `{"type": "image"}`) and their images
    in order: an image part holds a PIL image (`image`) or a data URL (`image_url`)."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image" and is_image(part.get("image")):
                    images.append(part["image"])
                elif kind == "image_url":
                    url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else part.get("image_url")
                    images.append(decode_data_url(url, f"{where}, message {i}, content part {j}"))
                elif kind == "text":
                    parts.append(part)
                    continue
                else:
                    raise UserError(
                        f"{where}, message {i}, content part {j} is {part!r:.120}: a content part is "
                        "{'type': 'text', 'text': ...}, {'type': 'image', 'image': <PIL image or bytes>} or "
                        "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}."
                    )
                parts.append({"type": "image"})
            m = {**m, "content": parts}
        out.append(m)
    return out, images


def is_messages(observation: Any) -> bool:
    return isinstance(observation, list) and bool(observation) and all(isinstance(m, dict) and "role" in m and "content" in m for m in observation)


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
