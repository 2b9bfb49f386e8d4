"""Preference data (`prompt`/`chosen`/`rejected`, or the conversational form, and an optional
numeric `margin` that algo=rm reads) for DPO and the other pairwise objectives.

Chosen and rejected are tokenized separately, each ending with EOS. Rows that cannot teach a
preference are skipped and counted, never silently kept: chosen equal to rejected, or an empty
completion. A missing column is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rltrain.config.schema import DataConfig
from rltrain.data import tasks
from rltrain.data.loading import PAIRED, PAIRED_IMPLICIT, eval_limit, train_and_eval_rows
from rltrain.data.tokenize import OverlongStats, check_messages, encode_all, fit_length
from rltrain.data.vision_inputs import VisionInputs
from rltrain.data.vision_rows import has_image_column, source_of, vision_pair_rows
from rltrain.runtime.errors import UserError


@dataclass
class PreferencePair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0  # the optional `margin` column: how much chosen must beat rejected by (algo=rm)
    vision: VisionInputs | None = None  # the prompt's images (rltrain.data.vision_rows), shared by both


@dataclass
class SkipCounts:
    identical: int = 0
    empty: int = 0
    overlong: OverlongStats = field(default_factory=OverlongStats)


@dataclass
class PreferenceData:
    train: list[PreferencePair]
    eval: list[PreferencePair]
    eval_answers: list[str]  # reference answers of the eval prompts (for greedy accuracy)
    skipped: SkipCounts


def pair_texts(tokenizer, row: dict, where: str) -> tuple[str, str, str]:
    prompt: Any = row.get("prompt")  # a dataset row's values: checked below
    chosen: Any = row.get("chosen")
    rejected: Any = row.get("rejected")
    if isinstance(chosen, list):  # conversational: lists of messages sharing the prompt turns
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: conversational rows need a tokenizer with a chat template.")
        check_messages(chosen, where, "chosen")
        check_messages(rejected, where, "rejected")
        if isinstance(prompt, list):
            check_messages(prompt, where, "prompt")
        context = prompt if isinstance(prompt, list) else chosen[:-1]
        if not context:
            raise UserError(
                f"{where}: a conversational row has no prompt turns: give a 'prompt' column of messages, or put the "
                "prompt's messages before the last (assistant) message of 'chosen' and 'rejected'."
            )
        prompt = tokenizer.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
        chosen, rejected = chosen[-1]["content"], rejected[-1]["content"]
    for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, str):
            raise UserError(f"{where}: column {name!r} must hold strings (or message lists); found {value!r:.120}")
    return prompt, chosen, rejected


def _margin(row: dict, where: str) -> float:
    value: Any = row.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(
            f"{where}: column 'margin' must hold finite numbers (how far the chosen completion's reward should exceed "
            f"the rejected one's); found {value!r:.120}. Fix the column or drop it."
        )
    return float(value)


def rows_to_pairs(
    tokenizer, rows: list[dict], data_cfg: DataConfig, where: str, skipped: SkipCounts, processor=None
) -> list[PreferencePair]:
    """Rows with images go through the vision-language model's `processor` (rltrain.data.vision_rows)."""
    eos = tokenizer.eos_token_id
    max_length, overlong = data_cfg.max_length, data_cfg.overlong  # read once: a config lookup per row adds up
    with_images = has_image_column(rows)
    vision_rows = vision_pair_rows(processor, rows, source_of(data_cfg.path, where)) if with_images else []
    usable: list[tuple[str, str, str]] = []
    margins: list[float] = []
    kept: list[int] = []
    for i, row in enumerate(rows):
        if with_images:
            prompt, chosen, rejected = "", vision_rows[i].chosen, vision_rows[i].rejected
        else:
            prompt, chosen, rejected = pair_texts(tokenizer, row, where)
        if chosen == rejected:
            skipped.identical += 1
        elif not chosen or not rejected:
            skipped.empty += 1
        else:
            usable.append((prompt, chosen, rejected))
            margins.append(_margin(row, where))
            kept.append(i)
    # one tokenizer call per column, not three per row (the per-call overhead dominates short texts)
    prompts_ids, chosen_ids, rejected_ids = (encode_all(tokenizer, [texts[i] for texts in usable]) for i in range(3))
    if with_images:
        prompts_ids = [vision_rows[i].prompt for i in kept]
    visions = [vision_rows[i].vision for i in kept] if with_images else [None] * len(kept)
    pairs = []
    for prompt_ids, c_ids, r_ids, margin, vision in zip(prompts_ids, chosen_ids, rejected_ids, margins, visions, strict=True):
        if not prompt_ids:
            raise UserError(f"{where}: a row has an empty prompt; DPO needs at least one prompt token.")
        c_ids, r_ids = c_ids + [eos], r_ids + [eos]
        longest = max(len(c_ids), len(r_ids))
        fitted = fit_length(prompt_ids, [0] * longest, max_length, overlong, skipped.overlong, where)
        if fitted is None:
            continue
        keep = len(fitted.completion)
        pairs.append(PreferencePair(prompt_ids, c_ids[:keep], r_ids[:keep], margin, vision))
    return pairs


def build_preference_data(tokenizer, data_cfg: DataConfig, seed: int, processor=None) -> PreferenceData:
    """`processor`: a vision-language model's (None for a text-only model), for rows with images."""
    skipped = SkipCounts()
    if data_cfg.path is None:
        train_p, eval_p = tasks.answer_split(data_cfg, seed)
        where = f"built-in task {data_cfg.task!r}"
        share = data_cfg.same_length_rejected
        train_rows, eval_rows = tasks.preference_rows(train_p, seed, share), tasks.preference_rows(eval_p, seed + 7, share)
        answers = [p.answer for p in eval_p]
    else:
        train_rows, eval_rows, where = train_and_eval_rows(data_cfg, seed, [PAIRED, PAIRED_IMPLICIT])
        answers = []
    train = rows_to_pairs(tokenizer, train_rows, data_cfg, where, skipped, processor)
    if not train:
        raise UserError(f"{where}: no usable preference pairs (identical, empty or overlong rows were all skipped).")
    limit = eval_limit(data_cfg)
    evals = rows_to_pairs(tokenizer, eval_rows[:limit], data_cfg, where, SkipCounts(), processor)
    return PreferenceData(train, evals, answers[:limit], skipped)
