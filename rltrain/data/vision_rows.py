"""Rows with images (TRL's vision formats) into prompt token ids plus the row's encoded images.

An `images` column (a list) or `image` (one) holds `datasets` Image values, PIL images, bytes, or
file paths relative to the dataset file. A prompt marks where each image goes: `{"type": "image"}`
content parts in conversational rows, `<image>` in text rows (verl's layout); the counts must match.
The model's processor then expands each image into its visual tokens. docs/vision.md.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltrain.data.vision_inputs import VisionInputs
from rltrain.runtime.errors import UserError

IMAGE_PLACEHOLDER = "<image>"  # in a text prompt: one image, in order
IMAGE_COLUMNS = ("images", "image")
# Processor outputs that are per-token (rebuilt from the padded ids at the model call) or the ids.
TEXT_OUTPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


@dataclass
class RowSource:
    """Where a row came from, for error messages and relative image paths."""

    where: str  # e.g. "data.path='shapes.jsonl'"
    base_dir: Path  # the dataset file's directory


def source_of(data_path: str | None, where: str) -> RowSource:
    path = Path(data_path).expanduser() if data_path else Path.cwd()
    return RowSource(where, path if path.is_dir() else path.parent)


def has_image_column(rows: list[dict]) -> bool:
    return any(row.get(c) is not None for row in rows[:1] for c in IMAGE_COLUMNS)


def row_images(row: dict, index: int, source: RowSource) -> list[Any]:
    """The row's images as PIL images (none: an empty list)."""
    value = next((row[c] for c in IMAGE_COLUMNS if row.get(c) is not None), None)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [open_image(v, index, source) for v in values]


def columns_with_images(row: dict, index: int, source: RowSource, images: list, image_columns: tuple[str, ...]) -> dict:
    """The row's columns but `prompt`, for the reward functions, environments and judges that read
    them: each of `image_columns` (`images`, `image`, and the column `data.columns.images` names)
    as RGB PIL images, a list for a list and one for one, whichever layout the dataset gave (paths,
    bytes, `datasets` Image values, PIL). A column holding what the row's `images` were read from
    gets those very images, so each is decoded once."""
    read_from = next((row[c] for c in IMAGE_COLUMNS if row.get(c) is not None), None)
    columns = {}
    for key, value in row.items():
        if key == "prompt":
            continue
        if key in image_columns and value is not None:
            if value is read_from or value == read_from:
                value = list(images) if isinstance(value, list) else images[0]
            elif isinstance(value, list):
                value = [open_image(v, index, source) for v in value]
            else:
                value = open_image(value, index, source)
        columns[key] = value
    return columns


def open_image(value: Any, index: int, source: RowSource):
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):  # the datasets Image feature, undecoded
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value)).convert("RGB")
        if isinstance(value, str):
            path = Path(value).expanduser()
            path = path if path.is_absolute() else source.base_dir / path
            return Image.open(path).convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise UserError(
            f"{source.where}: row {index} names an image that cannot be read ({value!r:.120}: "
            f"{type(exc).__name__}: {exc}). Give PIL images, image bytes or paths (relative to the dataset file) "
            "of existing image files."
        ) from exc
    raise UserError(
        f"{source.where}: row {index} has an image of type {type(value).__name__}; images are PIL images, "
        "image bytes, datasets Image values or file paths."
    )


def image_parts(messages: list[dict]) -> int:
    """How many `{"type": "image"}` content parts a conversation holds."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") in ("image", "image_url")
    )


def message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or [] if isinstance(p, dict) and p.get("type") == "text")


def check_placeholders(found: int, images: int, index: int, source: RowSource, marker: str) -> None:
    if found != images:
        raise UserError(
            f"{source.where}: row {index} has {images} image(s) but its prompt marks {found} ({marker}); "
            "put one marker where each image goes, in the order of the row's images."
        )


class VisionEncoder:
    """A vision-language model's processor applied to one row's prompt text and images."""

    def __init__(self, processor) -> None:
        self.processor = processor
        tokenizer = processor.tokenizer
        image_token = processor.image_token
        vocab = tokenizer.get_vocab()
        # Qwen2-VL's layout wraps the image token; others (LLaVA) use it alone.
        wrapped = "<|vision_start|>" in vocab and "<|vision_end|>" in vocab
        self.image_markup = f"<|vision_start|>{image_token}<|vision_end|>" if wrapped else image_token

    def text_prompt(self, prompt: str, images: list, index: int, source: RowSource) -> str:
        """A text prompt with `<image>` placeholders, in the model's own image markup."""
        check_placeholders(prompt.count(IMAGE_PLACEHOLDER), len(images), index, source, f"{IMAGE_PLACEHOLDER!r} placeholders")
        return prompt.replace(IMAGE_PLACEHOLDER, self.image_markup) if self.image_markup != IMAGE_PLACEHOLDER else prompt

    def prompt_text(self, prompt: Any, images: list, index: int, source: RowSource) -> Any:
        """A row's prompt in the model's text: messages with `{"type": "image"}` parts through the
        chat template, text with `<image>` placeholders in the model's markup; any other value is
        returned as it is, for the caller's own error."""
        if isinstance(prompt, list):
            check_placeholders(image_parts(prompt), len(images), index, source, '{"type": "image"} content parts')
            return self.processor.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if isinstance(prompt, str):
            return self.text_prompt(prompt, images, index, source)
        return prompt

    def encode(self, prompt_text: str, images: list) -> tuple[list[int], VisionInputs | None]:
        """(prompt ids with each image's visual tokens, the row's image tensors or None)."""
        if not images:
            ids = self.processor.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
            return list(ids), None
        out = self.processor(text=[prompt_text], images=images, return_tensors="pt", add_special_tokens=False)
        tensors = {k: v for k, v in out.items() if k not in TEXT_OUTPUTS}
        return out["input_ids"][0].tolist(), VisionInputs(tensors, len(images))

    def images_only(self, images: list) -> VisionInputs | None:
        """`images` encoded as `encode` encodes them beside a prompt (None: no image): an episode's
        images, whose placeholders its ids already hold (rltrain/envs)."""
        return self.encode(self.image_markup * len(images), images)[1] if images else None


def vision_prompt_completion(
    encoder: VisionEncoder, row: dict, index: int, source: RowSource
) -> tuple[list[int], str, VisionInputs | None]:
    """(prompt ids, completion text, images) of an SFT row: `messages` (the last one the
    assistant's), conversational `prompt`/`completion` lists, or text `prompt`/`completion`."""
    images = row_images(row, index, source)
    tokenizer = encoder.processor.tokenizer
    prompt: Any  # a dataset row's values: checked below
    completion: Any
    conversation: Any = row.get("messages") if row.get("prompt") is None else None
    if conversation is None and isinstance(row.get("prompt"), list):
        conversation = list(row["prompt"]) + list(row.get("completion") or [])
    if conversation is not None:
        if not isinstance(conversation, list) or len(conversation) < 2 or conversation[-1].get("role") != "assistant":
            raise UserError(
                f"{source.where}: row {index}'s conversation must end with the assistant's message (the completion) "
                "after at least one other (the prompt)."
            )
        check_placeholders(image_parts(conversation[:-1]), len(images), index, source, '{"type": "image"} content parts')
        prompt = tokenizer.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
        completion = message_text(conversation[-1])
    else:
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise UserError(f"{source.where}: row {index} needs string 'prompt' and 'completion' values (or 'messages').")
        prompt = encoder.text_prompt(prompt, images, index, source)
    ids, vision = encoder.encode(prompt, images)
    return ids, completion, vision


def vision_encoder(processor, source: RowSource) -> VisionEncoder:
    """The encoder of rows with images from `source`; `processor` None (a text-only model) is refused."""
    if processor is None:
        raise UserError(
            f"{source.where} has images (an 'images' or 'image' column) but the model is text-only. Train a "
            "vision-language model (model=tiny_vl, or model.path of one that AutoModelForImageTextToText loads), "
            "or drop the image column."
        )
    return VisionEncoder(processor)


def rows_with_images(processor, rows: list[dict], source: RowSource) -> Iterator[tuple[VisionEncoder, int, dict, list[Any]]]:
    """(the processor's encoder, index, row, the row's images) for each row; `processor` None (a
    text-only model) is refused before the first."""
    encoder = vision_encoder(processor, source)
    for index, row in enumerate(rows):
        yield encoder, index, row, row_images(row, index, source)


@dataclass
class VisionPairRow:
    """A preference row with images: its prompt ids (visual tokens included), completion texts and images."""

    prompt: list[int]
    chosen: str
    rejected: str
    vision: VisionInputs | None


def vision_pair_rows(processor, rows: list[dict], source: RowSource) -> list[VisionPairRow]:
    """Preference rows (`prompt` text with `<image>` or messages, `chosen`/`rejected` texts or
    message lists) with their images; `processor` None (a text-only model) is refused."""
    out = []
    for encoder, index, row, images in rows_with_images(processor, rows, source):
        prompt: Any = row.get("prompt")  # a dataset row's values: checked below
        chosen: Any = row.get("chosen")
        rejected: Any = row.get("rejected")
        if isinstance(chosen, list) and isinstance(rejected, list) and chosen and rejected:
            prompt = encoder.prompt_text(prompt if isinstance(prompt, list) else chosen[:-1], images, index, source)
            chosen, rejected = message_text(chosen[-1]), message_text(rejected[-1])
        else:
            prompt = encoder.prompt_text(prompt, images, index, source)
        if not (isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)):
            raise UserError(f"{source.where}: row {index} needs 'prompt', 'chosen' and 'rejected' as strings or message lists.")
        ids, vision = encoder.encode(prompt, images)
        out.append(VisionPairRow(ids, chosen, rejected, vision))
    return out


@dataclass
class VisionLabelledRow:
    """An unpaired row with images (KTO): its prompt ids (visual tokens included), completion text,
    label and images."""

    prompt: list[int]
    completion: str
    desirable: bool
    vision: VisionInputs | None


def vision_unpaired_rows(processor, rows: list[dict], source: RowSource) -> list[VisionLabelledRow]:
    """TRL's unpaired rows (`prompt` text with `<image>` or messages, `completion` text or message
    list, boolean `label`) with their images; `processor` None (a text-only model) is refused."""
    out = []
    for encoder, index, row, images in rows_with_images(processor, rows, source):
        prompt = encoder.prompt_text(row.get("prompt"), images, index, source)
        completion: Any = row.get("completion")  # a dataset row's values: checked below
        label: Any = row.get("label")
        if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
            completion = message_text(completion[-1])
        if not (isinstance(prompt, str) and isinstance(completion, str) and isinstance(label, bool)):
            raise UserError(
                f"{source.where}: row {index} needs 'prompt' and 'completion' as strings or message lists and a "
                "boolean 'label' (TRL's unpaired preference format)."
            )
        ids, vision = encoder.encode(prompt, images)
        out.append(VisionLabelledRow(ids, completion, label, vision))
    return out


@dataclass
class VisionPrompt:
    """An RL prompt with images: `text` has one image markup per image (what a rollout engine reads
    beside `images`), `ids` each image's visual tokens expanded (what the trainer scores)."""

    text: str
    ids: list[int]
    chat: bool
    images: list
    vision: VisionInputs | None


def vision_prompts(processor, rows: list[dict], source: RowSource) -> list[VisionPrompt]:
    """RL prompts (`prompt` text with `<image>`, or messages with image parts) with their images."""
    out = []
    for encoder, index, row, images in rows_with_images(processor, rows, source):
        chat = isinstance(row.get("prompt"), list)
        prompt = encoder.prompt_text(row.get("prompt"), images, index, source)
        if not isinstance(prompt, str) or not prompt:
            raise UserError(f"{source.where}: row {index} needs a non-empty 'prompt' (text or messages).")
        ids, vision = encoder.encode(prompt, images)
        out.append(VisionPrompt(prompt, ids, chat, images, vision))
    return out
