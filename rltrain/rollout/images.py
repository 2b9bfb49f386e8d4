"""Images in rollout prompts: what an engine is given, and how images cross a boundary.

A prompt with images is its token ids as the model's processor writes them (each image's
placeholder expanded to its visual tokens: the ids the trainer's forward sees) plus that row's
images in placeholder order. vLLM expands placeholders itself, so its engines collapse each run of
the image token back to one and check that vLLM's expansion gives the row's ids again (the same
image processor settings on both sides); a row given with one placeholder per image is expanded
by vLLM and the completion carries the expanded prompt. Between processes (`rollout.process=
separate`) and to API servers (`rollout=server`) an image travels as a PNG data URL inside JSON:
lossless, and decoding accepts PNG only, never a pickle. docs/vision.md, "Rollouts with images".
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

# One prompt's images, in the order of its placeholders; a batch has one entry per prompt.
PromptImages = Sequence["Image"]
DATA_URL_PREFIX = "data:image/png;base64,"


def check_batch(prompts: Sequence[Sequence[int]], images: Sequence[PromptImages] | None) -> None:
    """Images, where given, are one list per prompt."""
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"generate got {len(images)} image lists for {len(prompts)} prompts: give one list per prompt")


def collapse_placeholders(ids: Sequence[int], token_id: int) -> list[int]:
    """`ids` with every run of `token_id` shortened to one token: the form vLLM expands."""
    out: list[int] = []
    for tok in ids:
        if tok != token_id or not out or out[-1] != token_id:
            out.append(int(tok))
    return out


def vllm_prompt(index: int, ids: Sequence[int], images: PromptImages | None, token_id: int | None) -> dict[str, Any]:
    """vLLM's token prompt for one row: its ids, and where it has images, the ids collapsed to one
    placeholder per image (vLLM expands them again) with the images as `multi_modal_data`."""
    if not images:
        return {"prompt_token_ids": [int(t) for t in ids]}
    if token_id is None:
        raise ValueError(
            f"prompt {index} has images but the rollout engine's model is text-only (its config names no image token): "
            "use a vision-language model, or give no images"
        )
    runs = placeholder_runs(ids, token_id)
    if runs != len(images):
        raise ValueError(
            f"prompt {index} has {runs} image placeholder(s) but {len(images)} image(s): give one image per placeholder"
        )
    return {"prompt_token_ids": collapse_placeholders(ids, token_id), "multi_modal_data": {"image": list(images)}}


def placeholder_runs(ids: Sequence[int], token_id: int) -> int:
    """How many separate runs of `token_id` (one per image) `ids` holds."""
    return sum(1 for i, tok in enumerate(ids) if tok == token_id and (i == 0 or ids[i - 1] != token_id))


def expanded_prompt(index: int, given: Sequence[int], engine_ids: Sequence[int], token_id: int) -> list[int] | None:
    """None when the engine's expanded prompt is the row's own; the engine's prompt when the row
    held one placeholder per image (then the completion continues that prompt); an error when the
    row was already expanded, differently (the processors disagree on an image's size)."""
    if list(engine_ids) == list(given):
        return None
    if collapse_placeholders(given, token_id) == list(given):
        return [int(t) for t in engine_ids]
    mine, theirs = sum(t == token_id for t in given), sum(t == token_id for t in engine_ids)
    raise ValueError(
        f"prompt {index}: its {placeholder_runs(given, token_id)} image(s) take {mine} visual tokens in the trainer's "
        f"ids but {theirs} in the rollout engine's: the two resize images differently. Use the model directory's "
        "own preprocessor settings (min_pixels/max_pixels) for the data, or give the prompt with one placeholder per image."
    )


def to_data_url(image: Image) -> str:
    """An image as a lossless PNG data URL (RGB: what the processors convert every image to)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return DATA_URL_PREFIX + base64.b64encode(buf.getvalue()).decode("ascii")


def from_data_url(url: str, formats: tuple[str, ...] = ("PNG",)) -> Image:
    """The image of a base64 data URL in one of `formats` (PIL's names; PNG, what `to_data_url`
    writes, by default); anything else is refused, never decoded with a format guessed from the bytes."""
    from PIL import Image as PILImage

    kind = url.partition(";")[0].removeprefix("data:image/").upper() if isinstance(url, str) else ""
    kind = "JPEG" if kind == "JPG" else kind
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url or kind not in formats:
        names = ", ".join(f"data:image/{f.lower()};base64,..." for f in formats)
        raise ValueError(f"an image must be a data URL ({names}), got {str(url)[:40]!r}")
    try:
        data = base64.b64decode(url.partition(";base64,")[2], validate=True)
        image = PILImage.open(io.BytesIO(data), formats=[kind])
        image.load()
    except (binascii.Error, OSError) as exc:
        raise ValueError(f"an image data URL does not hold a {kind} image: {exc}") from exc
    return image


def images_to_json(images: Sequence[PromptImages] | None) -> list[list[str]] | None:
    return None if images is None else [[to_data_url(im) for im in row] for row in images]


def images_from_json(rows: Any) -> list[list[Image]] | None:
    if rows is None:
        return None
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise ValueError("images must be a list of lists of PNG data URLs")
    return [[from_data_url(url) for url in row] for row in rows]
