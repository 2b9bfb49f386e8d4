"""SFT data: the built-in task or a user dataset, tokenized into prompt / completion pairs."""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config.schema import DataConfig
from rltrain.data import tasks
from rltrain.data.loading import eval_limit, train_and_eval_rows
from rltrain.data.tokenize import (
    OverlongStats,
    TokenizedPair,
    encode,
    encode_all,
    fit_length,
    render_messages,
)
from rltrain.data.vision_inputs import VisionInputs
from rltrain.data.vision_rows import has_image_column, source_of
from rltrain.data.vision_sft import vision_eval_items, vision_sft_pairs
from rltrain.runtime.errors import UserError


@dataclass
class EvalItem:
    prompt: list[int]
    reference: str  # the completion text an exact match must reproduce
    vision: VisionInputs | None = None  # the prompt's images (a vision-language model)


@dataclass
class SFTData:
    train: list[TokenizedPair]
    eval: list[EvalItem]
    overlong: OverlongStats


def text_rows(data_cfg: DataConfig, seed: int, eos: str) -> tuple[list[dict], list[dict], str]:
    """(train rows, eval rows, where) for prompt/completion-style data; `eos` is the tokenizer's
    end-of-sequence text (a built-in tool demonstration ends its call turn with it)."""
    if data_cfg.path is None:
        train, held_out = tasks.builtin_split(data_cfg, seed)
        return (
            tasks.sft_rows(train, eos, forgotten_carries=data_cfg.forgotten_carries),
            tasks.sft_rows(held_out, eos, demonstrations=False),
            f"built-in task {data_cfg.task!r}",
        )
    return train_and_eval_rows(data_cfg, seed, [("prompt", "completion"), ("messages",)])


def row_texts(tokenizer, row: dict, where: str) -> tuple[str, str]:
    if "messages" in row and row.get("messages") is not None and "prompt" not in row:
        return render_messages(tokenizer, row["messages"], where)
    prompt, completion = row.get("prompt"), row.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise UserError(f"{where}: every row needs string 'prompt' and 'completion' values; found {row!r:.200}")
    return prompt, completion


def build_sft_data(tokenizer, data_cfg: DataConfig, seed: int, processor=None) -> SFTData:
    """`processor`: a vision-language model's (None for a text-only model); rows with images need
    one (rltrain.data.vision_sft)."""
    train_rows, eval_rows, where = text_rows(data_cfg, seed, tokenizer.eos_token)
    if has_image_column(train_rows):
        source = source_of(data_cfg.path, where)
        pairs, skipped = vision_sft_pairs(processor, train_rows, source, data_cfg)
        held_out = [EvalItem(*item) for item in vision_eval_items(processor, eval_rows[: eval_limit(data_cfg)], source)]
        return SFTData(pairs, held_out, skipped)
    stats = OverlongStats()
    eos = tokenizer.eos_token_id
    max_length, overlong = data_cfg.max_length, data_cfg.overlong  # read once: a config lookup per row adds up
    train: list[TokenizedPair] = []
    texts = [row_texts(tokenizer, row, where) for row in train_rows]
    prompts_ids = encode_all(tokenizer, [prompt for prompt, _ in texts])
    completions_ids = encode_all(tokenizer, [completion for _, completion in texts])
    for prompt_ids, completion_ids in zip(prompts_ids, completions_ids, strict=True):
        if not prompt_ids:
            raise UserError(f"{where}: a row has an empty prompt; every row needs at least one prompt token.")
        pair = fit_length(prompt_ids, completion_ids + [eos], max_length, overlong, stats, where)
        if pair is not None:
            train.append(pair)
    if not train:
        raise UserError(f"{where}: no training rows are left (all were dropped as longer than data.max_length).")
    evals = []
    for row in eval_rows[: eval_limit(data_cfg)]:
        prompt, completion = row_texts(tokenizer, row, where)
        evals.append(EvalItem(encode(tokenizer, prompt), completion))
    return SFTData(train, evals, stats)
