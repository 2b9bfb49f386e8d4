"""Unpaired preference data for KTO: each example is one completion with a boolean label (TRL's
unpaired format: `prompt`, `completion`, `label`, standard or conversational). Paired rows
(`prompt`/`chosen`/`rejected`, or an implicit prompt) are unpaired as TRL does: chosen -> true,
rejected -> false; the built-in task's pairs the same way. Rows with images carry them with each
example (rltrain.data.vision_rows).

Held-out data is kept as pairs for `eval/dpo_accuracy`: the built-in task's and a paired dataset's
as they are; an unpaired dataset's by matching, per prompt (and its images), its i-th desirable
with its i-th undesirable completion. docs/algorithms.md, "KTO"; docs/vision.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from rltrain.config.schema import DataConfig
from rltrain.data import tasks
from rltrain.data.loading import PAIRED, PAIRED_IMPLICIT, UNPAIRED, eval_limit, train_and_eval_rows
from rltrain.data.preference_data import PreferencePair, SkipCounts, pair_texts, rows_to_pairs
from rltrain.data.tokenize import check_messages, encode_all, fit_length
from rltrain.data.vision_inputs import VisionInputs
from rltrain.data.vision_rows import has_image_column, source_of, vision_pair_rows, vision_unpaired_rows
from rltrain.runtime.errors import UserError


@dataclass
class LabelledCompletion:
    prompt: list[int]
    completion: list[int]  # ends with EOS
    desirable: bool  # the `label` column
    vision: VisionInputs | None = None  # the prompt's images (rltrain.data.vision_rows)


@dataclass
class LabelledText:
    """One labelled completion before tokenizing; a row with images has its prompt encoded
    already (visual tokens expanded), which its images ride with."""

    prompt: str | list[int]
    completion: str
    desirable: bool
    vision: VisionInputs | None = None


@dataclass
class UnpairedData:
    train: list[LabelledCompletion]
    eval: list[PreferencePair]  # held-out pairs (module docstring)
    eval_answers: list[str]  # reference answers of the eval prompts (the built-in task's)
    skipped: SkipCounts


def unpaired_texts(tokenizer, row: dict, where: str) -> tuple[str, str, bool]:
    """(prompt text, completion text, label) of one unpaired row, standard or conversational."""
    prompt: Any = row.get("prompt")  # a dataset row's values: checked below
    completion: Any = row.get("completion")
    label: Any = row.get("label")
    if not isinstance(label, bool):
        raise UserError(
            f"{where}: column 'label' must hold booleans (true: the completion is desirable, false: undesirable; TRL's "
            f"unpaired preference format); found {label!r:.120}. Convert it with data.map_fn."
        )
    if isinstance(completion, list):  # conversational: the prompt's messages, then the completion's
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: conversational rows need a tokenizer with a chat template.")
        check_messages(completion, where, "completion")
        check_messages(prompt, where, "prompt")
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        completion = completion[-1]["content"]
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise UserError(f"{where}: column {name!r} must hold strings (or message lists); found {value!r:.120}")
    return prompt, completion, label


def unpair(tokenizer, rows: list[dict], where: str) -> list[LabelledText]:
    """Paired rows as labelled texts: each pair's chosen (true) then its rejected (false)."""
    texts = []
    for row in rows:
        prompt, chosen, rejected = pair_texts(tokenizer, row, where)
        texts += [LabelledText(prompt, chosen, True), LabelledText(prompt, rejected, False)]
    return texts


def labelled_texts(tokenizer, rows: list[dict], where: str, processor=None, data_path: str | None = None) -> list[LabelledText]:
    """Unpaired or paired rows (the first row's columns decide) as labelled texts; rows with images
    through the vision-language model's `processor` (None: a text-only model, refused)."""
    unpaired = bool(rows) and all(k in rows[0] for k in UNPAIRED)
    if not has_image_column(rows):
        if unpaired:
            return [LabelledText(*unpaired_texts(tokenizer, row, where)) for row in rows]
        return unpair(tokenizer, rows, where)
    source = source_of(data_path, where)
    if unpaired:
        return [LabelledText(r.prompt, r.completion, r.desirable, r.vision) for r in vision_unpaired_rows(processor, rows, source)]
    return [
        LabelledText(r.prompt, completion, desirable, r.vision)
        for r in vision_pair_rows(processor, rows, source)
        for completion, desirable in ((r.chosen, True), (r.rejected, False))
    ]


def texts_to_examples(
    tokenizer, texts: list[LabelledText], data_cfg: DataConfig, where: str, skipped: SkipCounts
) -> list[LabelledCompletion]:
    usable = [t for t in texts if t.completion]
    skipped.empty += len(texts) - len(usable)
    # one tokenizer call for the text prompts; a prompt with images comes encoded (its visual tokens)
    text_prompts = iter(encode_all(tokenizer, [t.prompt for t in usable if isinstance(t.prompt, str)]))
    prompts_ids = [t.prompt if isinstance(t.prompt, list) else next(text_prompts) for t in usable]
    completions_ids = encode_all(tokenizer, [t.completion for t in usable])
    eos = tokenizer.eos_token_id
    examples = []
    for prompt_ids, completion_ids, text in zip(prompts_ids, completions_ids, usable, strict=True):
        if not prompt_ids:
            raise UserError(f"{where}: a row has an empty prompt; KTO needs at least one prompt token.")
        fitted = fit_length(prompt_ids, completion_ids + [eos], data_cfg.max_length, data_cfg.overlong, skipped.overlong, where)
        if fitted is not None:  # fit_length never cuts a prompt, so its visual tokens stay whole
            examples.append(LabelledCompletion(fitted.prompt, fitted.completion, text.desirable, text.vision))
    return examples


def images_key(vision: VisionInputs | None) -> str:
    """A digest of a prompt's encoded images: prompts with equal text but other images differ."""
    if vision is None:
        return ""
    digest = hashlib.sha256()
    for name in sorted(vision.tensors):
        raw = vision.tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype's bytes
        digest.update(name.encode() + raw.numpy().tobytes())
    return digest.hexdigest()


def held_out_pairs(examples: list[LabelledCompletion]) -> list[PreferencePair]:
    """Per prompt (its text and its images), its i-th desirable completion against its i-th
    undesirable one."""
    by_prompt: dict[tuple[tuple[int, ...], str], tuple[LabelledCompletion, list[list[int]], list[list[int]]]] = {}
    for ex in examples:
        _, good, bad = by_prompt.setdefault((tuple(ex.prompt), images_key(ex.vision)), (ex, [], []))
        (good if ex.desirable else bad).append(ex.completion)
    return [
        PreferencePair(list(first.prompt), c, r, vision=first.vision)
        for first, good, bad in by_prompt.values()
        for c, r in zip(good, bad)
        if c != r
    ]


def build_unpaired_data(tokenizer, data_cfg: DataConfig, seed: int, processor=None) -> UnpairedData:
    """`processor`: a vision-language model's (None for a text-only model), for rows with images."""
    skipped = SkipCounts()
    limit = eval_limit(data_cfg)
    if data_cfg.path is None:
        train_p, eval_p = tasks.answer_split(data_cfg, seed)
        where = f"built-in task {data_cfg.task!r}"
        share = data_cfg.same_length_rejected
        train_texts = labelled_texts(tokenizer, tasks.preference_rows(train_p, seed, share), where, processor)
        evals = rows_to_pairs(tokenizer, tasks.preference_rows(eval_p, seed + 7, share), data_cfg, where, SkipCounts(), processor)
        answers = [p.answer for p in eval_p]
    else:
        train_rows, eval_rows, where = train_and_eval_rows(data_cfg, seed, [UNPAIRED, PAIRED, PAIRED_IMPLICIT])
        answers = []
        train_texts = labelled_texts(tokenizer, train_rows, where, processor, data_cfg.path)
        if train_rows and all(k in train_rows[0] for k in UNPAIRED):
            eval_texts = labelled_texts(tokenizer, eval_rows[:limit], where, processor, data_cfg.path)
            evals = held_out_pairs(texts_to_examples(tokenizer, eval_texts, data_cfg, where, SkipCounts()))
        else:
            evals = rows_to_pairs(tokenizer, eval_rows[:limit], data_cfg, where, SkipCounts(), processor)
    train = texts_to_examples(tokenizer, train_texts, data_cfg, where, skipped)
    if not train:
        raise UserError(f"{where}: no usable examples (empty or overlong rows were all skipped).")
    return UnpairedData(train, evals, answers[:limit], skipped)
