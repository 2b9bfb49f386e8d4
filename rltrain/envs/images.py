"""Images in the rows user code receives, and in the image parts of messages.

A row's images reach an agent as PNG data URLs (its prompt's `{"type": "image"}` parts become
`image_url` parts, ready to send) and an environment's `reset` as PIL images (across the worker
pipe: rltrain/envs/wire.py). An image part's data URL is decoded here; a remote URL is refused.
docs/vision.md, "Agents, environments and tools".
"""

from __future__ import annotations

from typing import Any

from rltrain.data.prompt_data import PromptRow
from rltrain.rollout.images import from_data_url, to_data_url
from rltrain.runtime.errors import UserError


def with_image_urls(messages: list[dict[str, Any]], urls: list[str]) -> list[dict[str, Any]]:
    """A dataset's prompt messages with each `{"type": "image"}` part an OpenAI `image_url` part
    holding the row's next image (in order), so an agent can send the messages as they are."""
    pending = iter(urls)
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": next(pending, "")}}
                if isinstance(p, dict) and p.get("type") == "image" else p
                for p in content
            ]
        out.append({**m, "content": content})
    return out


def agent_row(row: PromptRow) -> dict[str, Any]:
    """The row an agent receives: `prompt` (its messages, image parts as data URLs, or its text),
    every other column, and `images`: the row's images as PNG data URLs. Every other image column
    (PIL images in a row's columns: rltrain.data.vision_rows.columns_with_images) is data URLs too,
    so the row is JSON an agent can send as it is."""
    if not row.images:
        return {"prompt": row.messages or row.text, **row.columns}
    from PIL import Image

    encoded: dict[int, str] = {}  # the prompt's images are in its image columns too: encoded once

    def as_urls(value: Any) -> Any:
        if isinstance(value, Image.Image):
            if id(value) not in encoded:
                encoded[id(value)] = to_data_url(value)
            return encoded[id(value)]
        return [as_urls(v) for v in value] if isinstance(value, list) else value

    urls = [as_urls(im) for im in row.images]
    columns = {key: as_urls(value) for key, value in row.columns.items()}
    columns["images"] = urls  # whatever the dataset's image column was called
    prompt = with_image_urls(row.messages, urls) if row.messages else row.text
    return {"prompt": prompt, **columns}


def environment_row(row: PromptRow) -> dict[str, Any]:
    """The row an environment's `reset` receives (after `to_wire`, the image column as PIL images)."""
    columns = dict(row.columns)
    if row.images:
        columns["images"] = list(row.images)  # whatever the dataset's image column was called
    return {"prompt": row.text, **columns}


def decode_data_url(url: Any, where: str) -> Any:
    """An image part's data URL as a PIL image (RGB); a remote URL or another format is a UserError."""
    try:
        return from_data_url(url, ("PNG", "JPEG", "WEBP")).convert("RGB")
    except ValueError as exc:
        raise UserError(
            f"{where}: {exc}. Images are given inline (a PIL image, image bytes, or a base64 data URL), never fetched "
            "from a remote URL."
        ) from None
