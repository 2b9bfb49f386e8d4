"""Row columns across the call workers' JSON pipe (rltrain/runtime/call_pool.py), which carries
plain data only: a reward function gets every column of its rows, and a row's images are PIL images
(rltrain.data.vision_rows.columns_with_images), a column may hold bytes. `to_wire` turns each PIL
image into `{"rltrain_png": BASE64}` (lossless, its mode kept) and each bytes value into
`{"rltrain_bytes": BASE64}`; `from_wire`, in the worker, turns them back. A step's completions share
their rows' images, so each image is encoded once (`to_wire` remembers the objects it has seen) and
decoded once per call (`from_wire` remembers the markers). Light on purpose: workers import it.
docs/rewards-and-roles.md.
"""

from __future__ import annotations

import base64
import io
import sys
from typing import Any

PNG_KEY = "rltrain_png"
BYTES_KEY = "rltrain_bytes"


def _is_pil(value: Any) -> bool:
    """Whether `value` is a PIL image; a process that has not imported PIL holds none."""
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)


def to_wire(value: Any, seen: dict[int, dict[str, str]] | None = None) -> Any:
    """`value` with every PIL image and bytes value (in lists, tuples and dicts too) replaced by a
    JSON-safe marker; `seen` maps the images already encoded (by object) to their markers."""
    seen = {} if seen is None else seen
    if isinstance(value, (bytes, bytearray)):
        return {BYTES_KEY: base64.b64encode(bytes(value)).decode("ascii")}
    if _is_pil(value):
        if id(value) not in seen:
            buf = io.BytesIO()
            value.save(buf, format="PNG")
            seen[id(value)] = {PNG_KEY: base64.b64encode(buf.getvalue()).decode("ascii")}
        return seen[id(value)]
    if isinstance(value, (list, tuple)):
        return [to_wire(v, seen) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v, seen) for k, v in value.items()}
    return value


def from_wire(value: Any, decoded: dict[str, Any] | None = None) -> Any:
    """`value` with every marker a PIL image or bytes again (the worker's side); `decoded` maps the
    PNG markers already decoded to their images, so equal markers give one image."""
    decoded = {} if decoded is None else decoded
    if isinstance(value, dict) and len(value) == 1 and PNG_KEY in value:
        data = value[PNG_KEY]
        if data not in decoded:
            from PIL import Image

            image = Image.open(io.BytesIO(base64.b64decode(data)))
            image.load()
            decoded[data] = image
        return decoded[data]
    if isinstance(value, dict) and len(value) == 1 and BYTES_KEY in value:
        return base64.b64decode(value[BYTES_KEY])
    if isinstance(value, list):
        return [from_wire(v, decoded) for v in value]
    if isinstance(value, dict):
        return {k: from_wire(v, decoded) for k, v in value.items()}
    return value
