"""What crosses the call workers' JSON pipe (rltrain/runtime/call_pool.py) for episodes with images,
and a tool's call on the worker's side.

An environment's observation or a tool's result may hold images (PIL images or image bytes, alone,
in a list or in a message's content parts). The worker turns each into `{"rltrain_image": BASE64}`
(`to_wire`: PNG for a PIL image, the bytes as given); the trainer turns them back (`from_wire`), an
unreadable image a UserError naming who returned it. Light on purpose: workers import it.
docs/vision.md, "Agents, environments and tools".
"""

from __future__ import annotations

import base64
import io
from typing import Any

from rltrain.runtime.errors import UserError
from rltrain.runtime.user_code import load_callable

WIRE_KEY = "rltrain_image"


def is_image(value: Any) -> bool:
    """Whether `value` is a PIL image (PIL imported only when asked)."""
    from PIL import Image

    return isinstance(value, Image.Image)


def to_wire(value: Any) -> Any:
    """`value` with every PIL image and every bytes value replaced by a JSON-safe marker (the
    worker's side: the pipe carries JSON only)."""
    if isinstance(value, (bytes, bytearray)):
        return {WIRE_KEY: base64.b64encode(bytes(value)).decode("ascii")}
    if is_image(value):
        buf = io.BytesIO()
        value.convert("RGB").save(buf, format="PNG")
        return {WIRE_KEY: base64.b64encode(buf.getvalue()).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def from_wire(value: Any, where: str) -> Any:
    """`value` with every marker made an RGB PIL image again (the trainer's side); an image that
    cannot be read is a UserError naming `where` (the environment or tool that returned it)."""
    if isinstance(value, dict) and set(value) == {WIRE_KEY}:
        from PIL import Image, UnidentifiedImageError

        data = base64.b64decode(value[WIRE_KEY])
        try:
            return Image.open(io.BytesIO(data)).convert("RGB")
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            problem = "no image format PIL knows" if isinstance(exc, UnidentifiedImageError) else f"{type(exc).__name__}: {exc}"
            raise UserError(
                f"{where} returned an image that cannot be read ({len(data)} bytes starting {data[:12]!r}: {problem}). Return "
                "a PIL image, or the bytes of a PNG, JPEG or WEBP file."
            ) from None
    if isinstance(value, list):
        return [from_wire(v, where) for v in value]
    if isinstance(value, dict):
        return {k: from_wire(v, where) for k, v in value.items()}
    return value


def call_tool(tool: str, arguments: dict[str, Any]) -> Any:
    """Call `tool` (`package.module:function`) with `arguments`; its result ready for the pipe."""
    return to_wire(load_callable("env.tools entry", tool)(**arguments))
