"""Prompt data for online RL: the prompt plus every other column, which reward functions read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rltrain.config.schema import DataConfig
from rltrain.data import tasks
from rltrain.data.loading import eval_limit, train_and_eval_rows
from rltrain.data.tokenize import check_messages, encode_all
from rltrain.data.vision_inputs import VisionInputs
from rltrain.data.vision_rows import (
    IMAGE_COLUMNS,
    RowSource,
    columns_with_images,
    has_image_column,
    source_of,
    vision_prompts,
)
from rltrain.runtime.errors import UserError


@dataclass
class PromptRow:
    ids: list[int]
    text: str
    columns: dict = field(default_factory=dict)
    chat: bool = False  # the prompt was chat messages, rendered by the chat template
    messages: list[dict] | None = None  # those messages as the dataset gave them (env=agent's row; None: text)
    # A vision-language model's prompt images: as given (PIL, for the rollout engine beside `text`) and
    # encoded by its processor (for the trainer; `ids` then holds each image's visual tokens). docs/vision.md.
    images: list | None = None
    vision: VisionInputs | None = None


class PromptRenderer(Protocol):
    """Renders a prompt as the text the model reads (env=tools offers its tools this way)."""

    def text(self, prompt: str) -> str: ...

    def chat(self, messages: list[dict]) -> str: ...


def _prompt_text(tokenizer, row: dict, where: str, renderer: PromptRenderer | None) -> tuple[str, bool]:
    """The text the model reads for `row`, and whether it was chat messages; a UserError names a bad row."""
    prompt = row["prompt"]
    chat = isinstance(prompt, list)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: conversational prompts need a tokenizer with a chat template.")
        check_messages(prompt, where, "prompt")
        if renderer is not None:
            prompt = renderer.chat(prompt)
        else:
            prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str) or not prompt:
        raise UserError(f"{where}: every row needs a non-empty 'prompt'; found {row.get('prompt')!r:.120}")
    if renderer is not None and not chat:
        prompt = renderer.text(prompt)
    return prompt, chat


def _to_rows(
    tokenizer, rows: list[dict], where: str, max_length: int, renderer: PromptRenderer | None
) -> tuple[list[PromptRow], int]:
    """The rows that fit in `max_length` tokens, in order, and how many did not."""
    rendered = [_prompt_text(tokenizer, row, where, renderer) for row in rows]
    all_ids = encode_all(tokenizer, [text for text, _ in rendered])
    kept = [
        PromptRow(ids, text, {k: v for k, v in row.items() if k != "prompt"}, chat, row["prompt"] if chat else None)
        for row, (text, chat), ids in zip(rows, rendered, all_ids, strict=True)
        if len(ids) <= max_length
    ]
    return kept, len(rows) - len(kept)


def _to_vision_rows(
    processor, rows: list[dict], source: RowSource, max_length: int, image_columns: tuple[str, ...]
) -> tuple[list[PromptRow], int]:
    """`_to_rows` for rows with images (rltrain.data.vision_rows). The images travel in `images` for
    the engines, and among the columns (`image_columns` as PIL images) for the reward functions,
    environments and judges (docs/rewards-and-roles.md)."""
    encoded = vision_prompts(processor, rows, source)
    kept = [
        PromptRow(p.ids, p.text, columns_with_images(row, index, source, p.images, image_columns), p.chat,
                  row["prompt"] if p.chat else None, p.images, p.vision)
        for index, (row, p) in enumerate(zip(rows, encoded, strict=True))
        if len(p.ids) <= max_length
    ]
    return kept, len(rows) - len(kept)


def build_prompt_data(
    tokenizer, data_cfg: DataConfig, seed: int, renderer: PromptRenderer | None = None, processor=None
) -> tuple[list[PromptRow], list[PromptRow], int]:
    """(train prompts, eval prompts, prompts dropped as longer than data.max_length); `processor`:
    a vision-language model's (None for a text-only model), for rows with images."""
    if data_cfg.path is None:
        train_p, eval_p = tasks.builtin_split(data_cfg, seed)
        train_rows, eval_rows, where = tasks.prompt_rows(train_p), tasks.prompt_rows(eval_p), "built-in task"
    else:
        train_rows, eval_rows, where = train_and_eval_rows(data_cfg, seed, [("prompt",)])
    max_length = data_cfg.max_length
    if has_image_column(list(train_rows)):
        source = source_of(data_cfg.path, where)
        image_columns = (*IMAGE_COLUMNS, *([data_cfg.columns.images] if data_cfg.columns.images else []))
        train, dropped = _to_vision_rows(processor, list(train_rows), source, max_length, image_columns)
        evals, _ = _to_vision_rows(processor, list(eval_rows), source, max_length, image_columns)
        if not train:
            raise UserError(f"{where}: no prompts left (all longer than data.max_length={max_length}, visual tokens included).")
        return train, evals[: eval_limit(data_cfg)], dropped
    train, dropped = _to_rows(tokenizer, list(train_rows), where, max_length, renderer)
    if not train:
        hint = " (env=tools lists the tools in each text prompt: raise data.max_length, or set env.describe_tools=false)" if renderer else ""
        raise UserError(f"{where}: no prompts left (all longer than data.max_length={max_length}){hint}.")
    evals, _ = _to_rows(tokenizer, list(eval_rows), where, max_length, renderer)
    return train, evals[: eval_limit(data_cfg)], dropped
