"""`rollout=server` with images: what a request to vLLM's token-in/token-out endpoint
(`/inference/v1/generate`) carries for a prompt's images, and what its answer says back.

The prompt goes as token ids with one placeholder per image (the server expands them, as the
in-process engine's vLLM does), each image as an `image_url` content part holding a PNG data URL
(rollout/images.py), and `return_token_ids` so that the answer names the expanded prompt, checked
against the row's as in-process. `chat_image_part` is the same image in the OpenAI chat API's own
content part, and `message_images` reads such parts back (agents' messages). docs/vision.md,
"Rollouts with images".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rltrain.models.vision import image_token_id
from rltrain.rollout.images import (
    PromptImages,
    expanded_prompt,
    from_data_url,
    to_data_url,
    vllm_prompt,
)

# What an agent may send in a chat message's `image_url` part (base64 data URLs; no remote URLs).
CHAT_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def model_image_token(model_dir: str | Path) -> int | None:
    """The image placeholder id of the model directory's config.json (None: text-only), read
    without transformers (the fleet's trainer side never builds the model)."""
    return image_token_id(json.loads((Path(model_dir) / "config.json").read_text()))


def generate_fields(index: int, ids: list[int], images: PromptImages | None, token_id: int | None) -> dict[str, Any]:
    """The request body's `token_ids`, and for a prompt with images its `content_parts` and
    `return_token_ids`; a mismatched row raises as the in-process engine does."""
    prompt = vllm_prompt(index, ids, images, token_id)
    fields: dict[str, Any] = {"token_ids": prompt["prompt_token_ids"]}
    if images:
        fields["content_parts"] = [{"type": "image_url", "url": to_data_url(image)} for image in images]
        fields["return_token_ids"] = True
    return fields


def answered_prompt(index: int, ids: list[int], answer: dict[str, Any], token_id: int | None) -> list[int] | None:
    """The completion's `prompt_ids` for a prompt sent with images: None when the server's expanded
    prompt is the row's own (rollout/images.py, `expanded_prompt`)."""
    if token_id is None or answer.get("prompt_token_ids") is None:
        return None
    return expanded_prompt(index, ids, [int(t) for t in answer["prompt_token_ids"]], token_id)


def chat_image_part(image: Any) -> dict[str, Any]:
    """An image as an OpenAI chat content part (`{"type": "image_url", "image_url": {"url": ...}}`)."""
    return {"type": "image_url", "image_url": {"url": to_data_url(image)}}


def message_images(messages: list[dict[str, Any]]) -> list[Any]:
    """The images of OpenAI chat `messages` in order (each `image_url` part's data URL decoded),
    for the engine beside the messages' rendering, whose template writes one placeholder per image
    part. A part that is not a PNG, JPEG or WEBP data URL raises, naming the message and part."""
    images = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
                try:
                    images.append(from_data_url(str(url), CHAT_IMAGE_FORMATS))
                except ValueError as exc:
                    raise ValueError(f"messages[{i}].content[{j}]: {exc}") from exc
    return images
